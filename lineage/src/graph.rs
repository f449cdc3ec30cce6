//! The lineage graph as Marquez shows it: jobs and datasets as nodes, an edge from each
//! input dataset to its job and from each job to its outputs. Pure: folded from OpenLineage
//! events (Aether's own and those sent to it), in any order, with no I/O.
//!
//! Why fold order does not matter: every property is kept by event time (created = the
//! earliest event, updated and facets = the latest, a version's time = its earliest write),
//! so Aether's records and external events can be folded source by source, and a
//! point-in-time graph is the same fold over the events up to that time.
//!
//! Node ids are Marquez's: `job:<namespace>:<name>` and `dataset:<namespace>:<name>`.
//! Namespaces may hold `:` (`aether://model`, `s3://bucket`), so an id is resolved against
//! the nodes that exist ([`LineageGraph::resolve`]).
//!
//! Dataset versions: an output with a `version` facet makes that version (a digest, or the
//! Delta table version for `delta/events`); an output without one makes a version named by
//! the run that wrote it, when the run completed (a failed write changes nothing). Inputs
//! never make versions.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

/// Why an event could not be folded into the graph.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("not an OpenLineage event: {0}")]
    Json(#[from] serde_json::Error),
    #[error("eventTime {0:?} is not an RFC 3339 time")]
    EventTime(String),
}

/// A job or dataset: its namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name {
    pub namespace: String,
    pub name: String,
}

/// Which kind of node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeKind {
    Job,
    Dataset,
}

/// A node of the graph.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeRef {
    pub kind: NodeKind,
    pub name: Name,
}

impl NodeRef {
    /// The Marquez node id.
    pub fn id(&self) -> String {
        let prefix = match self.kind {
            NodeKind::Job => "job",
            NodeKind::Dataset => "dataset",
        };
        format!("{prefix}:{}:{}", self.name.namespace, self.name.name)
    }
}

/// The parts of an OpenLineage event the graph reads; facets stay unparsed text.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    event_type: Option<String>,
    event_time: String,
    run: Option<EventRun>,
    job: Option<EventJob>,
    #[serde(default)]
    inputs: Vec<EventDataset>,
    #[serde(default)]
    outputs: Vec<EventDataset>,
    dataset: Option<EventDataset>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EventRun {
    run_id: String,
    facets: Option<Box<RawValue>>,
}

#[derive(Deserialize)]
struct EventJob {
    namespace: String,
    name: String,
    facets: Option<Box<RawValue>>,
    #[serde(default)]
    inputs: Vec<EventDataset>,
    #[serde(default)]
    outputs: Vec<EventDataset>,
}

#[derive(Deserialize)]
struct EventDataset {
    namespace: String,
    name: String,
    facets: Option<HashMap<String, Box<RawValue>>>,
}

impl EventDataset {
    fn key(&self) -> Name {
        Name {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    /// `datasetVersion` of its `version` facet.
    fn version(&self) -> Option<String> {
        let raw = self.facets.as_ref()?.get("version")?;
        let facet: Value = serde_json::from_str(raw.get()).ok()?;
        facet.get("datasetVersion")?.as_str().map(str::to_owned)
    }

    fn facets_text(&self) -> Option<Box<RawValue>> {
        let facets = self.facets.as_ref().filter(|f| !f.is_empty())?;
        serde_json::value::to_raw_value(facets).ok()
    }
}

type Time = DateTime<Utc>;

/// A run as far as the events seen tell.
#[derive(Clone, Debug)]
struct RunState {
    id: String,
    state: &'static str,
    state_at: Time,
    created: Time,
    updated: Time,
    started: Option<Time>,
    ended: Option<Time>,
}

impl RunState {
    fn new(id: &str, event_type: Option<&str>, at: Time) -> RunState {
        let mut run = RunState {
            id: id.to_owned(),
            state: "NEW",
            state_at: at,
            created: at,
            updated: at,
            started: None,
            ended: None,
        };
        run.merge(event_type, at);
        run
    }

    /// Folds one event of this run: the latest state wins, a terminal state over another
    /// event at the same time.
    fn merge(&mut self, event_type: Option<&str>, at: Time) {
        self.created = self.created.min(at);
        self.updated = self.updated.max(at);
        let (state, terminal) = match event_type.unwrap_or("OTHER") {
            "START" => {
                self.started = Some(self.started.map_or(at, |s| s.min(at)));
                ("RUNNING", false)
            }
            "RUNNING" => ("RUNNING", false),
            "COMPLETE" => ("COMPLETED", true),
            "FAIL" => ("FAILED", true),
            "ABORT" => ("ABORTED", true),
            _ => return,
        };
        if terminal {
            self.ended = Some(self.ended.map_or(at, |e| e.max(at)));
        }
        if at > self.state_at || (at == self.state_at && terminal) || self.state == "NEW" {
            self.state = state;
            self.state_at = at;
        }
    }

    fn to_json(&self) -> Value {
        let duration = match (self.started, self.ended) {
            (Some(s), Some(e)) => Some((e - s).num_milliseconds()),
            _ => None,
        };
        json!({
            "id": self.id,
            "createdAt": time(self.created),
            "updatedAt": time(self.updated),
            "nominalStartTime": null,
            "nominalEndTime": null,
            "state": self.state,
            "startedAt": self.started.map(time),
            "endedAt": self.ended.map(time),
            "durationMs": duration,
            "args": {},
        })
    }
}

/// Facets as last reported, by the time they were reported at.
#[derive(Clone, Debug, Default)]
struct Facets(Option<(Time, Box<RawValue>)>);

impl Facets {
    fn offer(&mut self, at: Time, facets: Option<Box<RawValue>>) {
        let Some(facets) = facets.filter(|f| f.get() != "{}") else {
            return;
        };
        if self.0.as_ref().is_none_or(|(t, _)| at >= *t) {
            self.0 = Some((at, facets));
        }
    }

    fn to_json(&self) -> Value {
        self.0
            .as_ref()
            .and_then(|(_, f)| serde_json::from_str(f.get()).ok())
            .unwrap_or_else(|| json!({}))
    }
}

#[derive(Clone, Debug)]
struct JobNode {
    created: Time,
    updated: Time,
    inputs: BTreeSet<Name>,
    outputs: BTreeSet<Name>,
    facets: Facets,
    latest_run: Option<RunState>,
}

#[derive(Clone, Debug)]
struct DatasetVersion {
    created: Time,
    run_id: Option<String>,
}

#[derive(Clone, Debug)]
struct DatasetNode {
    created: Time,
    updated: Time,
    last_modified: Option<Time>,
    producers: BTreeSet<Name>,
    consumers: BTreeSet<Name>,
    facets: Facets,
    versions: BTreeMap<String, DatasetVersion>,
}

/// Jobs and datasets with their edges, folded from OpenLineage events.
#[derive(Clone, Debug, Default)]
pub struct LineageGraph {
    jobs: BTreeMap<Name, JobNode>,
    datasets: BTreeMap<Name, DatasetNode>,
    events: u64,
}

impl LineageGraph {
    /// Events folded so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Folds one OpenLineage event (run, dataset or job event), given as JSON text.
    pub fn apply_json(&mut self, json: &str) -> Result<(), GraphError> {
        let event: Event = serde_json::from_str(json)?;
        let at = parse_time(&event.event_time)
            .ok_or_else(|| GraphError::EventTime(event.event_time.clone()))?;
        self.events += 1;
        if let Some(dataset) = &event.dataset {
            let version = dataset.version();
            let node = self.dataset(dataset.key(), at);
            node.facets.offer(at, dataset.facets_text());
            if let Some(version) = version {
                add_version(node, version, at, None);
            }
        }
        let Some(job) = &event.job else {
            return Ok(());
        };
        let job_name = Name {
            namespace: job.namespace.clone(),
            name: job.name.clone(),
        };
        let node = self.job(job_name.clone(), at);
        node.facets.offer(at, job.facets.clone());
        if let Some(run) = &event.run {
            let event_type = event.event_type.as_deref();
            match &mut node.latest_run {
                Some(latest) if latest.id == run.run_id => latest.merge(event_type, at),
                Some(latest) if latest.updated > at => {}
                _ => node.latest_run = Some(RunState::new(&run.run_id, event_type, at)),
            }
        }
        let completed = event.run.is_none() || event.event_type.as_deref() == Some("COMPLETE");
        let run_id = event.run.as_ref().map(|r| r.run_id.clone());
        let inputs = event.inputs.iter().chain(&job.inputs);
        let outputs = event.outputs.iter().chain(&job.outputs);
        for input in inputs {
            self.link(&job_name, input, at, false);
        }
        for output in outputs {
            self.link(&job_name, output, at, true);
            let version = output.version().or_else(|| {
                // A run that wrote without naming a version made one (see above).
                run_id.clone().filter(|_| completed && event.run.is_some())
            });
            let node = self.dataset(output.key(), at);
            if completed {
                node.last_modified = Some(node.last_modified.map_or(at, |t| t.max(at)));
            }
            if let Some(version) = version {
                add_version(node, version, at, run_id.clone());
            }
        }
        Ok(())
    }

    fn job(&mut self, name: Name, at: Time) -> &mut JobNode {
        let node = self.jobs.entry(name).or_insert_with(|| JobNode {
            created: at,
            updated: at,
            inputs: BTreeSet::new(),
            outputs: BTreeSet::new(),
            facets: Facets::default(),
            latest_run: None,
        });
        node.created = node.created.min(at);
        node.updated = node.updated.max(at);
        node
    }

    fn dataset(&mut self, name: Name, at: Time) -> &mut DatasetNode {
        let node = self.datasets.entry(name).or_insert_with(|| DatasetNode {
            created: at,
            updated: at,
            last_modified: None,
            producers: BTreeSet::new(),
            consumers: BTreeSet::new(),
            facets: Facets::default(),
            versions: BTreeMap::new(),
        });
        node.created = node.created.min(at);
        node.updated = node.updated.max(at);
        node
    }

    fn link(&mut self, job: &Name, dataset: &EventDataset, at: Time, output: bool) {
        let key = dataset.key();
        let node = self.dataset(key.clone(), at);
        node.facets.offer(at, dataset.facets_text());
        if output {
            node.producers.insert(job.clone());
        } else {
            node.consumers.insert(job.clone());
        }
        if let Some(job) = self.jobs.get_mut(job) {
            if output {
                job.outputs.insert(key);
            } else {
                job.inputs.insert(key);
            }
        }
    }

    /// The node a Marquez node id names, if it exists.
    pub fn resolve(&self, node_id: &str) -> Option<NodeRef> {
        let (kind, rest) = if let Some(rest) = node_id.strip_prefix("job:") {
            (NodeKind::Job, rest)
        } else {
            (NodeKind::Dataset, node_id.strip_prefix("dataset:")?)
        };
        rest.match_indices(':').find_map(|(i, _)| {
            let name = Name {
                namespace: rest[..i].to_owned(),
                name: rest[i + 1..].to_owned(),
            };
            let exists = match kind {
                NodeKind::Job => self.jobs.contains_key(&name),
                NodeKind::Dataset => self.datasets.contains_key(&name),
            };
            exists.then_some(NodeRef { kind, name })
        })
    }

    /// Nodes one step upstream (`upstream`) or downstream of `node`.
    fn neighbours(&self, node: &NodeRef, upstream: bool) -> Vec<NodeRef> {
        let (kind, names) = match (node.kind, upstream) {
            (NodeKind::Job, true) => (
                NodeKind::Dataset,
                self.jobs.get(&node.name).map(|j| &j.inputs),
            ),
            (NodeKind::Job, false) => (
                NodeKind::Dataset,
                self.jobs.get(&node.name).map(|j| &j.outputs),
            ),
            (NodeKind::Dataset, true) => (
                NodeKind::Job,
                self.datasets.get(&node.name).map(|d| &d.producers),
            ),
            (NodeKind::Dataset, false) => (
                NodeKind::Job,
                self.datasets.get(&node.name).map(|d| &d.consumers),
            ),
        };
        names
            .into_iter()
            .flatten()
            .map(|name| NodeRef {
                kind,
                name: name.clone(),
            })
            .collect()
    }

    /// The nodes upstream and downstream of `start`, up to `depth` jobs away in each
    /// direction (a job at most `depth` job steps away, with the datasets it reads or
    /// writes in that direction).
    pub fn reachable(&self, start: &NodeRef, depth: u32) -> BTreeSet<NodeRef> {
        let hops = 2 * u64::from(depth) + u64::from(start.kind == NodeKind::Job);
        let mut found = BTreeSet::from([start.clone()]);
        for upstream in [true, false] {
            let mut frontier = vec![start.clone()];
            let mut seen = BTreeSet::from([start.clone()]);
            for _ in 0..hops {
                let next: Vec<NodeRef> = frontier
                    .iter()
                    .flat_map(|n| self.neighbours(n, upstream))
                    .filter(|n| seen.insert(n.clone()))
                    .collect();
                if next.is_empty() {
                    break;
                }
                frontier = next;
            }
            found.extend(seen);
        }
        found
    }

    /// `GET /api/v1/lineage`: the graph around `start`, in Marquez's shape (`{"graph":
    /// [...]}`), each node with the edges to other nodes of the answer.
    pub fn lineage(&self, start: &NodeRef, depth: u32) -> Value {
        let nodes = self.reachable(start, depth);
        let edge = |origin: &NodeRef, destination: &NodeRef| json!({ "origin": origin.id(), "destination": destination.id() });
        let graph: Vec<Value> = nodes
            .iter()
            .map(|node| {
                let ins: Vec<Value> = self
                    .neighbours(node, true)
                    .iter()
                    .filter(|n| nodes.contains(n))
                    .map(|n| edge(n, node))
                    .collect();
                let outs: Vec<Value> = self
                    .neighbours(node, false)
                    .iter()
                    .filter(|n| nodes.contains(n))
                    .map(|n| edge(node, n))
                    .collect();
                let (kind, data) = match node.kind {
                    NodeKind::Job => ("JOB", self.job_json(&node.name)),
                    NodeKind::Dataset => ("DATASET", self.dataset_json(&node.name)),
                };
                json!({
                    "id": node.id(),
                    "type": kind,
                    "data": data,
                    "inEdges": ins,
                    "outEdges": outs,
                })
            })
            .collect();
        json!({ "graph": graph })
    }

    /// Every namespace that holds a job or a dataset, in Marquez's shape.
    pub fn namespaces(&self) -> Vec<Value> {
        let mut spans: BTreeMap<&str, (Time, Time)> = BTreeMap::new();
        let times = self
            .jobs
            .iter()
            .map(|(n, j)| (n, j.created, j.updated))
            .chain(self.datasets.iter().map(|(n, d)| (n, d.created, d.updated)));
        for (name, created, updated) in times {
            let span = spans
                .entry(name.namespace.as_str())
                .or_insert((created, updated));
            span.0 = span.0.min(created);
            span.1 = span.1.max(updated);
        }
        spans
            .into_iter()
            .map(|(name, (created, updated))| {
                json!({
                    "name": name,
                    "createdAt": time(created),
                    "updatedAt": time(updated),
                    "ownerName": "anonymous",
                    "description": null,
                    "isHidden": false,
                })
            })
            .collect()
    }

    /// `GET /api/v1/search`: the jobs and datasets whose name or namespace contains `query`
    /// (ignoring case), of `kind` when given, in Marquez's search shape; by name, or newest
    /// first with `newest_first`.
    pub fn search(&self, query: &str, kind: Option<NodeKind>, newest_first: bool) -> Vec<Value> {
        let needle = query.to_lowercase();
        let matches = |n: &Name| {
            n.name.to_lowercase().contains(&needle) || n.namespace.to_lowercase().contains(&needle)
        };
        let jobs = self
            .jobs
            .iter()
            .filter(|_| kind != Some(NodeKind::Dataset))
            .map(|(n, j)| (NodeKind::Job, n, j.updated));
        let datasets = self
            .datasets
            .iter()
            .filter(|_| kind != Some(NodeKind::Job))
            .map(|(n, d)| (NodeKind::Dataset, n, d.updated));
        let mut found: Vec<(NodeKind, &Name, Time)> = jobs
            .chain(datasets)
            .filter(|(_, n, _)| matches(n))
            .collect();
        if newest_first {
            found.sort_by(|a, b| b.2.cmp(&a.2).then(a.1.cmp(b.1)));
        } else {
            found.sort_by(|a, b| {
                a.1.name
                    .cmp(&b.1.name)
                    .then(a.1.cmp(b.1))
                    .then(a.0.cmp(&b.0))
            });
        }
        found
            .into_iter()
            .map(|(kind, name, updated)| {
                let node = NodeRef {
                    kind,
                    name: name.clone(),
                };
                json!({
                    "type": if kind == NodeKind::Job { "JOB" } else { "DATASET" },
                    "name": name.name,
                    "updatedAt": time(updated),
                    "namespace": name.namespace,
                    "nodeId": node.id(),
                })
            })
            .collect()
    }

    /// One job or dataset in Marquez's shape (`GET /api/v1/namespaces/{ns}/jobs/{job}`,
    /// `.../datasets/{dataset}`); `None` when there is no such node.
    pub fn node_json(&self, kind: NodeKind, name: &Name) -> Option<Value> {
        match kind {
            NodeKind::Job => self.job_json(name),
            NodeKind::Dataset => self.dataset_json(name),
        }
    }

    /// One namespace in Marquez's shape (`GET /api/v1/namespaces/{ns}`).
    pub fn namespace(&self, name: &str) -> Option<Value> {
        self.namespaces().into_iter().find(|n| n["name"] == name)
    }

    /// `GET /api/v1/sources`: a source per namespace that holds datasets (Aether names a
    /// dataset's source by its namespace, as `sourceName` says), by name.
    pub fn sources(&self) -> Vec<Value> {
        let mut spans: BTreeMap<&str, (Time, Time)> = BTreeMap::new();
        for (name, d) in &self.datasets {
            let span = spans
                .entry(name.namespace.as_str())
                .or_insert((d.created, d.updated));
            span.0 = span.0.min(d.created);
            span.1 = span.1.max(d.updated);
        }
        spans
            .into_iter()
            .map(|(name, (created, updated))| {
                json!({
                    "type": "OPENLINEAGE",
                    "name": name,
                    "createdAt": time(created),
                    "updatedAt": time(updated),
                    "connectionUrl": name,
                    "description": null,
                })
            })
            .collect()
    }

    /// One version of a dataset (`GET .../datasets/{ds}/versions/{version}`).
    pub fn dataset_version(&self, name: &Name, version: &str) -> Option<Value> {
        self.dataset_versions(name)?
            .into_iter()
            .find(|v| v["version"] == version)
    }

    /// `GET /api/v1/column-lineage?nodeId=&depth=&withDownstream=`: the dataset fields
    /// linked by the `columnLineage` facets of the datasets, around a dataset (all its
    /// fields), one field (`datasetField:<ns>:<dataset>:<field>`) or a job (the fields of
    /// the datasets it writes), upstream up to `depth` steps and downstream too with
    /// `downstream`; in Marquez's shape (`{"graph": [...]}`, nodes `datasetField:…`). `None`
    /// when the node does not exist.
    pub fn column_lineage(&self, node_id: &str, depth: u32, downstream: bool) -> Option<Value> {
        // Every edge input field → output field the facets name, with the output's facet entry.
        type Field = (Name, String);
        let mut upstream: BTreeMap<Field, Vec<Field>> = BTreeMap::new();
        let mut details: BTreeMap<Field, Value> = BTreeMap::new();
        for (name, node) in &self.datasets {
            let facets = node.facets.to_json();
            let Some(fields) = facets["columnLineage"]["fields"].as_object() else {
                continue;
            };
            for (field, entry) in fields {
                let out = (name.clone(), field.clone());
                let inputs: Vec<Field> = entry["inputFields"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|i| {
                        Some((
                            Name {
                                namespace: i["namespace"].as_str()?.to_owned(),
                                name: i["name"].as_str()?.to_owned(),
                            },
                            i["field"].as_str()?.to_owned(),
                        ))
                    })
                    .collect();
                details.insert(out.clone(), entry.clone());
                upstream.entry(out).or_default().extend(inputs);
            }
        }
        let mut downstream_of: BTreeMap<Field, Vec<Field>> = BTreeMap::new();
        for (out, inputs) in &upstream {
            for input in inputs {
                downstream_of
                    .entry(input.clone())
                    .or_default()
                    .push(out.clone());
            }
        }
        let known = |f: &Field| upstream.contains_key(f) || downstream_of.contains_key(f);
        let start: Vec<Field> = if let Some(rest) = node_id.strip_prefix("datasetField:") {
            // `<ns>:<dataset>:<field>`; namespaces may hold `:`, so try each split.
            let found = rest.match_indices(':').find_map(|(i, _)| {
                let (ns, tail) = (&rest[..i], &rest[i + 1..]);
                let (dataset, field) = tail.rsplit_once(':')?;
                let f = (
                    Name {
                        namespace: ns.to_owned(),
                        name: dataset.to_owned(),
                    },
                    field.to_owned(),
                );
                known(&f).then_some(f)
            })?;
            vec![found]
        } else {
            let node = self.resolve(node_id.split('#').next().unwrap_or(node_id))?;
            let datasets: Vec<Name> = match node.kind {
                NodeKind::Dataset => vec![node.name],
                NodeKind::Job => self.jobs.get(&node.name)?.outputs.iter().cloned().collect(),
            };
            upstream
                .keys()
                .chain(downstream_of.keys())
                .filter(|(d, _)| datasets.contains(d))
                .cloned()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect()
        };
        let mut nodes: BTreeSet<Field> = start.iter().cloned().collect();
        let mut walk = |edges: &BTreeMap<Field, Vec<Field>>| {
            let mut frontier = start.clone();
            for _ in 0..depth {
                let next: Vec<Field> = frontier
                    .iter()
                    .flat_map(|f| edges.get(f).into_iter().flatten().cloned())
                    .filter(|f| nodes.insert(f.clone()))
                    .collect();
                if next.is_empty() {
                    break;
                }
                frontier = next;
            }
        };
        walk(&upstream);
        if downstream {
            walk(&downstream_of);
        }
        let id = |(d, f): &Field| format!("datasetField:{}:{}:{}", d.namespace, d.name, f);
        let edge = |from: &Field, to: &Field| json!({ "origin": id(from), "destination": id(to) });
        let graph: Vec<Value> = nodes
            .iter()
            .map(|field| {
                let inputs = upstream.get(field).cloned().unwrap_or_default();
                let outputs = downstream_of.get(field).cloned().unwrap_or_default();
                let entry = details.get(field);
                json!({
                    "id": id(field),
                    "type": "DATASET_FIELD",
                    "data": {
                        "namespace": field.0.namespace,
                        "dataset": field.0.name,
                        "datasetVersion": null,
                        "field": field.1,
                        "fieldType": null,
                        "transformationDescription": entry.map_or(Value::Null, |e| e["transformationDescription"].clone()),
                        "transformationType": entry.map_or(Value::Null, |e| e["transformationType"].clone()),
                        "inputFields": inputs.iter().map(|(d, f)| json!({ "namespace": d.namespace, "dataset": d.name, "datasetVersion": null, "field": f })).collect::<Vec<_>>(),
                    },
                    "inEdges": inputs.iter().filter(|i| nodes.contains(*i)).map(|i| edge(i, field)).collect::<Vec<_>>(),
                    "outEdges": outputs.iter().filter(|o| nodes.contains(*o)).map(|o| edge(field, o)).collect::<Vec<_>>(),
                })
            })
            .collect();
        Some(json!({ "graph": graph }))
    }

    /// The jobs of a namespace, in Marquez's shape, by name.
    pub fn jobs(&self, namespace: &str) -> Vec<Value> {
        in_namespace(&self.jobs, namespace, |n| self.job_json(n))
    }

    /// The datasets of a namespace, in Marquez's shape, by name.
    pub fn datasets(&self, namespace: &str) -> Vec<Value> {
        in_namespace(&self.datasets, namespace, |n| self.dataset_json(n))
    }

    /// The versions of a dataset, newest first; `None` when there is no such dataset.
    pub fn dataset_versions(&self, name: &Name) -> Option<Vec<Value>> {
        let node = self.datasets.get(name)?;
        let mut versions: Vec<(&String, &DatasetVersion)> = node.versions.iter().collect();
        versions.sort_by(|a, b| b.1.created.cmp(&a.1.created).then(b.0.cmp(a.0)));
        Some(
            versions
                .into_iter()
                .map(|(version, v)| {
                    json!({
                        "id": { "namespace": name.namespace, "name": name.name, "version": version },
                        "type": "DB_TABLE",
                        "name": name.name,
                        "physicalName": name.name,
                        "createdAt": time(v.created),
                        "version": version,
                        "namespace": name.namespace,
                        "sourceName": name.namespace,
                        "fields": [],
                        "tags": [],
                        "description": null,
                        "createdByRun": v.run_id.as_ref().map(|id| json!({ "id": id })),
                        "facets": {},
                    })
                })
                .collect(),
        )
    }

    fn job_json(&self, name: &Name) -> Option<Value> {
        let job = self.jobs.get(name)?;
        let facets = job.facets.to_json();
        let kind = facets["jobType"]["processingType"]
            .as_str()
            .unwrap_or("BATCH")
            .to_owned();
        let ids = |names: &BTreeSet<Name>| -> Vec<Value> {
            names
                .iter()
                .map(|n| json!({ "namespace": n.namespace, "name": n.name }))
                .collect()
        };
        Some(json!({
            "id": { "namespace": name.namespace, "name": name.name },
            "type": kind,
            "name": name.name,
            "simpleName": name.name,
            "parentJobName": null,
            "createdAt": time(job.created),
            "updatedAt": time(job.updated),
            "namespace": name.namespace,
            "inputs": ids(&job.inputs),
            "outputs": ids(&job.outputs),
            "location": null,
            "description": facets["documentation"]["description"].as_str(),
            "latestRun": job.latest_run.as_ref().map(RunState::to_json),
            "facets": facets,
            "currentVersion": null,
        }))
    }

    fn dataset_json(&self, name: &Name) -> Option<Value> {
        let dataset = self.datasets.get(name)?;
        let facets = dataset.facets.to_json();
        let fields: Vec<Value> = facets["schema"]["fields"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| {
                json!({
                    "name": f["name"],
                    "type": f.get("type").cloned().unwrap_or(Value::Null),
                    "tags": [],
                    "description": f.get("description").cloned().unwrap_or(Value::Null),
                })
            })
            .collect();
        let current = dataset
            .versions
            .iter()
            .max_by(|a, b| a.1.created.cmp(&b.1.created).then(a.0.cmp(b.0)))
            .map(|(v, _)| v.clone());
        Some(json!({
            "id": { "namespace": name.namespace, "name": name.name },
            "type": "DB_TABLE",
            "name": name.name,
            "physicalName": name.name,
            "createdAt": time(dataset.created),
            "updatedAt": time(dataset.updated),
            "namespace": name.namespace,
            "sourceName": name.namespace,
            "fields": fields,
            "tags": [],
            "lastModifiedAt": dataset.last_modified.map(time),
            "description": facets["documentation"]["description"].as_str(),
            "facets": facets,
            "currentVersion": current,
            "deleted": false,
        }))
    }
}

fn in_namespace<T>(
    nodes: &BTreeMap<Name, T>,
    namespace: &str,
    json: impl Fn(&Name) -> Option<Value>,
) -> Vec<Value> {
    nodes
        .keys()
        .filter(|n| n.namespace == namespace)
        .filter_map(json)
        .collect()
}

fn add_version(node: &mut DatasetNode, version: String, at: Time, run_id: Option<String>) {
    let entry = node
        .versions
        .entry(version)
        .or_insert_with(|| DatasetVersion {
            created: at,
            run_id: run_id.clone(),
        });
    if at < entry.created {
        entry.created = at;
        entry.run_id = run_id;
    }
}

/// `GET /api/v1/jobs/runs/{id}`: one run in Marquez's shape, from all of its events
/// (JSON text, any order); `None` when there are none.
pub fn run_from_events(events: &[String]) -> Result<Option<Value>, GraphError> {
    let mut run: Option<RunState> = None;
    let mut job: Option<(Time, Name)> = None;
    let mut inputs: BTreeMap<Name, Option<String>> = BTreeMap::new();
    let mut outputs: BTreeMap<Name, Option<String>> = BTreeMap::new();
    let mut facets: Vec<(Time, Map<String, Value>)> = Vec::new();
    for text in events {
        let event: Event = serde_json::from_str(text)?;
        let at = parse_time(&event.event_time)
            .ok_or_else(|| GraphError::EventTime(event.event_time.clone()))?;
        let Some(r) = &event.run else { continue };
        let event_type = event.event_type.as_deref();
        match &mut run {
            Some(state) => state.merge(event_type, at),
            None => run = Some(RunState::new(&r.run_id, event_type, at)),
        }
        if let Some(j) = &event.job
            && job.as_ref().is_none_or(|(t, _)| at >= *t)
        {
            job = Some((
                at,
                Name {
                    namespace: j.namespace.clone(),
                    name: j.name.clone(),
                },
            ));
        }
        for (side, datasets) in [(&mut inputs, &event.inputs), (&mut outputs, &event.outputs)] {
            for d in datasets {
                let version = d.version();
                let slot = side.entry(d.key()).or_default();
                if version.is_some() {
                    *slot = version;
                }
            }
        }
        if let Some(Value::Object(map)) = r
            .facets
            .as_ref()
            .and_then(|f| serde_json::from_str(f.get()).ok())
        {
            facets.push((at, map));
        }
    }
    let Some(run) = run else { return Ok(None) };
    // Later events' facets win, member by member.
    facets.sort_by_key(|(t, _)| *t);
    let merged: Map<String, Value> = facets.into_iter().flat_map(|(_, m)| m).collect();
    let versions = |side: BTreeMap<Name, Option<String>>| -> Vec<Value> {
        side.into_iter()
            .map(|(n, v)| json!({ "namespace": n.namespace, "name": n.name, "version": v }))
            .collect()
    };
    let mut out = run.to_json();
    if let Value::Object(map) = &mut out {
        map.insert(
            "jobVersion".into(),
            job.map_or(
                Value::Null,
                |(_, n)| json!({ "namespace": n.namespace, "name": n.name, "version": null }),
            ),
        );
        map.insert("inputVersions".into(), Value::Array(versions(inputs)));
        map.insert("outputVersions".into(), Value::Array(versions(outputs)));
        map.insert("facets".into(), Value::Object(merged));
    }
    Ok(Some(out))
}

/// An RFC 3339 time, in UTC.
pub fn parse_time(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// The event time of an OpenLineage event given as JSON text (`eventTime`), if readable.
pub fn event_time(json: &str) -> Option<DateTime<Utc>> {
    #[derive(Deserialize)]
    struct Timed {
        #[serde(rename = "eventTime")]
        event_time: String,
    }
    parse_time(&serde_json::from_str::<Timed>(json).ok()?.event_time)
}

fn time(t: Time) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(
        job: (&str, &str),
        run: &str,
        kind: &str,
        at: &str,
        inputs: &[(&str, &str)],
        outputs: &[(&str, &str, Option<&str>)],
    ) -> String {
        let inputs: Vec<Value> = inputs
            .iter()
            .map(|(ns, n)| json!({ "namespace": ns, "name": n }))
            .collect();
        let outputs: Vec<Value> = outputs
            .iter()
            .map(|(ns, n, v)| {
                let mut d = json!({ "namespace": ns, "name": n });
                if let Some(v) = v {
                    d["facets"] = json!({ "version": {
                        "_producer": "https://p", "_schemaURL": "https://s", "datasetVersion": v } });
                }
                d
            })
            .collect();
        json!({
            "eventType": kind, "eventTime": at, "producer": "https://p", "schemaURL": "https://s",
            "run": { "runId": run }, "job": { "namespace": job.0, "name": job.1 },
            "inputs": inputs, "outputs": outputs,
        })
        .to_string()
    }

    const FEATURES: (&str, &str) = ("s3://features", "trades");
    const MODEL: (&str, &str) = ("aether://model", "m@sgp");

    fn pipeline() -> LineageGraph {
        let mut g = LineageGraph::default();
        for e in [
            event(
                ("ml", "build_features"),
                "r1",
                "START",
                "2026-12-01T10:00:00Z",
                &[("s3://raw", "trades")],
                &[],
            ),
            event(
                ("ml", "build_features"),
                "r1",
                "COMPLETE",
                "2026-12-01T10:05:00Z",
                &[("s3://raw", "trades")],
                &[(FEATURES.0, FEATURES.1, None)],
            ),
            event(
                ("ml", "train"),
                "r2",
                "COMPLETE",
                "2026-12-01T11:00:00Z",
                &[FEATURES],
                &[(MODEL.0, MODEL.1, Some("digest-1"))],
            ),
            event(
                ("aether", "engine.activate"),
                "r3",
                "COMPLETE",
                "2026-12-01T12:00:00Z",
                &[MODEL],
                &[("delta", "events", Some("4"))],
            ),
        ] {
            g.apply_json(&e).unwrap();
        }
        g
    }

    #[test]
    fn node_ids_resolve_with_colons_in_namespaces() {
        let g = pipeline();
        let model = g.resolve("dataset:aether://model:m@sgp").unwrap();
        assert_eq!(model.name.namespace, "aether://model");
        assert_eq!(model.id(), "dataset:aether://model:m@sgp");
        assert!(g.resolve("job:ml:train").is_some());
        assert!(g.resolve("job:ml:nope").is_none());
        assert!(g.resolve("dataset:ml:train").is_none());
        assert!(g.resolve("other:ml:train").is_none());
    }

    #[test]
    fn lineage_walks_upstream_and_downstream_by_depth() {
        let g = pipeline();
        let model = g.resolve("dataset:aether://model:m@sgp").unwrap();
        let ids =
            |depth| -> Vec<String> { g.reachable(&model, depth).iter().map(NodeRef::id).collect() };
        let all = ids(20);
        for id in [
            "job:ml:build_features",
            "dataset:s3://raw:trades",
            "job:ml:train",
            "job:aether:engine.activate",
            "dataset:delta:events",
        ] {
            assert!(all.contains(&id.to_owned()), "{id} missing from {all:?}");
        }
        let near = ids(1);
        assert!(near.contains(&"dataset:s3://features:trades".to_owned()));
        assert!(
            !near.contains(&"job:ml:build_features".to_owned()),
            "{near:?}"
        );
        let graph = g.lineage(&model, 20);
        let train = graph["graph"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["id"] == "job:ml:train")
            .unwrap();
        assert_eq!(train["type"], "JOB");
        assert_eq!(
            train["inEdges"],
            json!([{ "origin": "dataset:s3://features:trades", "destination": "job:ml:train" }])
        );
        assert_eq!(
            train["outEdges"],
            json!([{ "origin": "job:ml:train", "destination": "dataset:aether://model:m@sgp" }])
        );
        assert_eq!(train["data"]["latestRun"]["state"], "COMPLETED");
    }

    #[test]
    fn fold_order_does_not_matter() {
        let events = [
            event(("ml", "j"), "r1", "START", "2026-12-01T10:00:00Z", &[], &[]),
            event(
                ("ml", "j"),
                "r1",
                "COMPLETE",
                "2026-12-01T10:00:02Z",
                &[],
                &[("ns", "d", Some("1"))],
            ),
            event(
                ("ml", "j"),
                "r2",
                "FAIL",
                "2026-12-01T10:00:05Z",
                &[],
                &[("ns", "d", None)],
            ),
        ];
        let mut a = LineageGraph::default();
        let mut b = LineageGraph::default();
        for e in &events {
            a.apply_json(e).unwrap();
        }
        for e in events.iter().rev() {
            b.apply_json(e).unwrap();
        }
        assert_eq!(a.jobs("ml"), b.jobs("ml"));
        assert_eq!(a.datasets("ns"), b.datasets("ns"));
        let job = &a.jobs("ml")[0];
        assert_eq!(job["latestRun"]["id"], "r2");
        assert_eq!(job["latestRun"]["state"], "FAILED");
        // The failed run wrote no version.
        let versions = a
            .dataset_versions(&Name {
                namespace: "ns".into(),
                name: "d".into(),
            })
            .unwrap();
        assert_eq!(versions.len(), 1);
        assert_eq!(versions[0]["version"], "1");
        assert_eq!(versions[0]["createdByRun"]["id"], "r1");
    }

    #[test]
    fn namespaces_and_runs() {
        let g = pipeline();
        let names: Vec<Value> = g.namespaces().iter().map(|n| n["name"].clone()).collect();
        assert_eq!(
            names,
            json!([
                "aether",
                "aether://model",
                "delta",
                "ml",
                "s3://features",
                "s3://raw"
            ])
            .as_array()
            .unwrap()
            .clone()
        );
        let run = run_from_events(&[
            event(
                ("ml", "build_features"),
                "r1",
                "COMPLETE",
                "2026-12-01T10:05:00Z",
                &[],
                &[(FEATURES.0, FEATURES.1, Some("v9"))],
            ),
            event(
                ("ml", "build_features"),
                "r1",
                "START",
                "2026-12-01T10:00:00Z",
                &[],
                &[],
            ),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(run["state"], "COMPLETED");
        assert_eq!(run["durationMs"], 300_000);
        assert_eq!(run["jobVersion"]["name"], "build_features");
        assert_eq!(run["outputVersions"][0]["version"], "v9");
        assert_eq!(run_from_events(&[]).unwrap(), None);
    }

    #[test]
    fn bad_events_are_refused_without_changing_the_graph() {
        let mut g = pipeline();
        let before = g.namespaces();
        assert!(g.apply_json("{").is_err());
        assert!(g.apply_json(r#"{"eventTime": "yesterday"}"#).is_err());
        assert_eq!(g.namespaces(), before);
    }
}
