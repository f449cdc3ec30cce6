//! `aether demo`: a rollout a newcomer can watch. It starts `aether serve` on embedded
//! defaults in a fresh data dir, registers the reference model and a candidate with a blind
//! spot for yen trades, activates the baseline, ingests a policy and a corpus, and starts
//! an automated rollout while clearing traffic flows. The controller widens the candidate
//! while the traffic is ordinary; when yen trades arrive its scores drift from the
//! baseline's, it is frozen at 0 %, and after three breaching windows the controller rolls
//! back on its own. The timeline is printed as the ledger records it, and everything stays
//! queryable in the audit API and the lineage graph afterwards.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aether_gateway::certs::{DevPkiSpec, PkiLayout, init_dev_pki};
use aether_gateway::client::ClearingClient;
use aether_gateway::identity::Role;
use aether_gateway::tls::TlsPaths;
use aether_gpu_worker::artifact::{self, load_verified};
use aether_gpu_worker::blind_spot::with_blind_spot;
use aether_gpu_worker::reference::{REFERENCE_MODEL_DIGEST, REFERENCE_MODEL_REF};
use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};

use aether_bench::node::{ServeChild, expect, http_request, post_json, setup_engine};
use aether_bench::trades::{SplitMix, trade_request, value_date};

/// The candidate's registry ref.
const CANDIDATE_REF: &str = "aether-anomaly-mlp-v2@reference";
/// The actor the rollout controller records under.
const CONTROLLER: &str = "aether:rollout-controller";
/// How many members trade. A clearing house has many members, each trading now and then:
/// the model reads a member's trades in the last minute (its velocity), and a few members
/// trading flat out would push that far past anything in its training data, where the
/// reference model flags two trades in five and is unsure of most, whichever stage scores
/// them. Forty members at about one trade a second keep every velocity under about 60 a
/// minute and give each one-second window about 40 trades.
const DEMO_MEMBERS: usize = 40;
/// The mean pause between one member's trades.
const MEMBER_PAUSE: Duration = Duration::from_secs(1);

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// A fresh directory for the demo's ledger, keys, models and Delta tables; kept
    /// afterwards so that everything can be queried.
    #[arg(long, default_value = "./aether-demo")]
    data_dir: PathBuf,
    /// Give up if the scenario has not ended after this many seconds.
    #[arg(long, default_value_t = 180)]
    timeout_secs: u64,
    /// Keep the service running after the scenario, until Ctrl-C.
    #[arg(long)]
    keep_running: bool,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let data = &args.data_dir;
    if data.exists()
        && std::fs::read_dir(data)
            .with_context(|| format!("cannot read {}", data.display()))?
            .next()
            .is_some()
    {
        bail!(
            "{} is not empty; the demo needs a fresh directory (remove it or pass --data-dir)",
            data.display()
        );
    }
    std::fs::create_dir_all(data).with_context(|| format!("cannot create {}", data.display()))?;
    let started = Instant::now();
    let say = |line: &str| println!("[{:>6.1}s] {line}", started.elapsed().as_secs_f64());

    say(&format!("starting aether serve in {}", data.display()));
    let mut server =
        ServeChild::start(data, &data.join("serve.log"), None, None, 2_000, "info").await?;
    let (operator, regulator) = read_tokens(&data.join("tokens"))?;
    let http = server.http.clone();
    let result = scenario(&args, &server, &operator, &regulator, &say).await;
    match &result {
        Ok(()) => {
            say("done; the service's ledger, Delta tables and lineage stay in the data dir");
            println!(
                "\n  audit API:   {http}/v1/audit/events?actor={CONTROLLER}\n  \
                 lineage UI:  {http}/ui\n  OpenAPI:     {http}/v1/openapi.json\n  \
                 tokens:      {} (operator and regulator)\n  \
                 these answer only while the service runs: pass --keep-running, or reopen \
                 the data later with\n    aether serve --data-dir {}\n  \
                 (it then listens on 127.0.0.1:8080 unless --listen says otherwise)",
                data.join("tokens").display(),
                data.display()
            );
        }
        Err(e) => say(&format!(
            "the demo failed: {}; the service log is serve.log",
            aether_gateway::errors::error_chain(e.as_ref())
        )),
    }
    if args.keep_running && result.is_ok() {
        println!("\n  the service keeps running; Ctrl-C stops it");
        crate::serve::shutdown_signal().await;
    }
    server.stop().await;
    result
}

async fn scenario(
    args: &DemoArgs,
    server: &ServeChild,
    operator: &str,
    regulator: &str,
    say: &dyn Fn(&str),
) -> anyhow::Result<()> {
    let data = &args.data_dir;
    let http = &server.http;
    setup_engine(http, data, operator, regulator).await?;
    say(&format!(
        "baseline {REFERENCE_MODEL_REF} active with policy aml_v2 and the sg-clearing corpus"
    ));
    let candidate = write_candidate(data)?;
    let model = json!({
        "ref": CANDIDATE_REF,
        "uri": candidate.0,
        "digest": candidate.1,
        "feature_schema": {"schema": "aether.features.v1"},
    });
    expect(
        post_json(http, "/v1/models", operator, &model).await?,
        201,
        "register the candidate",
    )?;
    say(&format!(
        "candidate {CANDIDATE_REF} registered: the reference model with a blind spot for JPY trades"
    ));

    // Traffic first, so the controller's first windows have evidence.
    let members = issue_member_certs(data)?;
    let yen = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let mut traffic = Vec::new();
    for (i, member) in members.into_iter().enumerate() {
        let client = connect(&server.grpc, data, &member).await?;
        traffic.push(tokio::spawn(submit_loop(
            client,
            member,
            i as u64,
            yen.clone(),
            stop.clone(),
            sent.clone(),
        )));
    }
    say(&format!(
        "{DEMO_MEMBERS} members trade over mTLS, each about once a second"
    ));
    let rollout = json!({
        "baseline": REFERENCE_MODEL_REF,
        "candidate": CANDIDATE_REF,
        "steps": [5, 25, 50, 100],
        "automated": true,
        "analysis": {
            "window": {"length_ms": 1000},
            "evidence": {"min_requests": 20, "min_shadow_sample": 10, "min_drift_samples": 10},
            // Drift from scores only: the demo's traffic has only just started, so a
            // feature such as the members' one-minute velocity is still ramping up and
            // every window's features differ from the first one's.
            "drift": {"ks_alpha": 0.0},
            // The reference model scores anomalies, not the reporting threshold the rules
            // enforce, so both models "clear" every large trade the rules hold; at a
            // release build's traffic nearly every window has one. The demo judges the
            // candidate on the other golden metrics.
            "sla": {"max_compliance_miss_rate": 1.0},
        },
    });
    let (status, body) = post_json(http, "/v1/rollouts", operator, &rollout).await?;
    expect((status, body.clone()), 201, "start the rollout")?;
    let id = serde_json::from_str::<Value>(&body)?["rollout"]["id"]
        .as_str()
        .context("no rollout id in the answer")?
        .to_owned();
    say(&format!(
        "automated rollout {id} started: steps 5, 25, 50, 100 %, 1 s analysis windows; \
         the controller raises the weight by half at a time \
         toward each step (5, 8, 12, 18, 25 ...) while the evidence holds"
    ));

    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let outcome = watch(http, operator, regulator, &id, deadline, &yen, say).await;
    stop.store(true, Ordering::Relaxed);
    for task in traffic {
        let _ = task.await;
    }
    let how = outcome?;
    say(&format!(
        "the candidate was {how} by the controller; {} trades were cleared meanwhile",
        sent.load(Ordering::Relaxed)
    ));
    if how == "rolled back" {
        probe_after_rollback(&server.grpc, data, say).await?;
    }
    explain_a_held_trade(&server.grpc, http, data, regulator, say).await
}

/// A trade the rules hold (over the reporting threshold), and what its explanation says:
/// the model's score taken apart by feature, each part with its interval, checked.
async fn explain_a_held_trade(
    grpc: &str,
    http: &str,
    data: &Path,
    regulator: &str,
    say: &dyn Fn(&str),
) -> anyhow::Result<()> {
    let member = "demo-member-01";
    let mut client = connect(grpc, data, member).await?;
    let mut request = trade_request(&mut SplitMix(7), member, &value_date());
    if let Some(trade) = request.trade.as_mut() {
        trade.amount_minor = 25_000_000;
    }
    client.submit("held-explained", &request).await?;
    let (status, body) = http_request(
        http,
        "GET",
        "/v1/audit/decisions/held-explained",
        regulator,
        None,
    )
    .await?;
    if status != 200 {
        bail!("the audit API answered {status}: {body}");
    }
    let why: Value = serde_json::from_str(&body)?;
    let e = &why["explanation"];
    let mut parts: Vec<&Value> = e["attributions"].as_array().into_iter().flatten().collect();
    parts.sort_by(|a, b| {
        let size = |v: &Value| v["value"].as_f64().unwrap_or(0.0).abs();
        size(b).total_cmp(&size(a))
    });
    let top: Vec<String> = parts
        .iter()
        .take(3)
        .map(|a| {
            format!(
                "{} {:+.3} [{:+.3}, {:+.3}]",
                a["feature"].as_str().unwrap_or("?"),
                a["value"].as_f64().unwrap_or(f64::NAN),
                a["ci95"][0].as_f64().unwrap_or(f64::NAN),
                a["ci95"][1].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect();
    say(&format!(
        "a held trade explained ({}, {}): score {:.3} against {:.3} for the training book,          most of it from {}; LIME fidelity error {:.3}; recompute it with          aether model explain --data-dir {} --request-id held-explained",
        why["decision"].as_str().unwrap_or("?"),
        e["status"].as_str().unwrap_or("no explanation"),
        e["score"].as_f64().unwrap_or(f64::NAN),
        e["base_value"].as_f64().unwrap_or(f64::NAN),
        top.join(", "),
        e["lime"]["fidelity_error"].as_f64().unwrap_or(f64::NAN),
        data.display(),
    ));
    Ok(())
}

/// Yen trades after the rollback: the candidate's blind spot. A rollback never raises the
/// candidate's exposure, so none of them may be decided by it.
async fn probe_after_rollback(grpc: &str, data: &Path, say: &dyn Fn(&str)) -> anyhow::Result<()> {
    const PROBES: u64 = 30;
    let member = "demo-member-01";
    let mut client = connect(grpc, data, member).await?;
    let mut rng = SplitMix(u64::MAX / 3);
    let date = value_date();
    let mut by_candidate = 0;
    for n in 0..PROBES {
        let mut request = trade_request(&mut rng, member, &date);
        if let Some(trade) = request.trade.as_mut() {
            trade.currency = "JPY".into();
        }
        let answer = client
            .submit(&format!("after-rollback-{n}"), &request)
            .await?;
        if answer.model_stage.starts_with("green") {
            by_candidate += 1;
        }
    }
    say(&format!(
        "after the rollback: {PROBES} yen trades, {by_candidate} decided by the candidate"
    ));
    if by_candidate > 0 {
        bail!("the rolled-back candidate still decided {by_candidate} of {PROBES} trades");
    }
    Ok(())
}

/// Prints the controller's events as the ledger records them, shifts the traffic to yen
/// once the candidate has reached 25 %, and returns how the rollout ended.
async fn watch(
    http: &str,
    operator: &str,
    regulator: &str,
    id: &str,
    deadline: Instant,
    yen: &AtomicBool,
    say: &dyn Fn(&str),
) -> anyhow::Result<&'static str> {
    let mut cursor = 0;
    let mut shifted = false;
    loop {
        if Instant::now() > deadline {
            bail!("the rollout did not end in time (--timeout-secs)");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (status, body) = http_request(
            http,
            "GET",
            &format!("/v1/audit/events?actor={CONTROLLER}&cursor={cursor}&limit=500"),
            regulator,
            None,
        )
        .await?;
        if status != 200 {
            bail!("the audit API answered {status}: {body}");
        }
        let page: Value = serde_json::from_str(&body)?;
        let mut ended = None;
        for event in page["events"].as_array().into_iter().flatten() {
            cursor = event["seq"].as_u64().unwrap_or(cursor);
            if let Some(line) = describe(event) {
                say(&line);
            }
            match event["event_type"].as_str() {
                // Too little traffic in a window (a loaded machine): the controller pauses
                // and never aborts; the demo resumes as an operator would.
                Some("AnalysisPaused") if event["payload"]["reason"] == "inconclusive" => {
                    let (status, body) = post_json(
                        http,
                        &format!("/v1/rollouts/{id}/resume"),
                        operator,
                        &json!({}),
                    )
                    .await?;
                    match status {
                        200 => say(
                            "too little traffic in a window paused the analysis; the demo \
                             resumes the rollout, as an operator would",
                        ),
                        // Already moved on (resumed, or ended by the controller).
                        409 => {}
                        _ => bail!("cannot resume the rollout: HTTP {status}: {body}"),
                    }
                }
                Some("RolledBack") => ended = Some("rolled back"),
                Some("RolloutPromoted") => ended = Some("promoted"),
                // A rollback with no snapshot to restore aborts the rollout.
                Some("RolloutAborted") => ended = Some("withdrawn (rollout aborted)"),
                Some("RolloutWeightSet")
                    if !shifted && event["payload"]["to_weight"].as_u64() >= Some(25) =>
                {
                    shifted = true;
                    yen.store(true, Ordering::Relaxed);
                    say("the traffic mix shifts: most trades are now in JPY");
                }
                _ => {}
            }
        }
        if let Some(how) = ended {
            return Ok(how);
        }
    }
}

/// Writes the candidate next to the baseline the setup installed; returns its path and
/// digest.
fn write_candidate(data: &Path) -> anyhow::Result<(String, String)> {
    let reference = load_verified(
        &data.join("model").join(artifact::WEIGHTS_FILE),
        REFERENCE_MODEL_DIGEST,
    )
    .context("cannot read the reference model the setup installed")?;
    let (spec, weights) = with_blind_spot(
        &reference.spec,
        &reference.weights,
        "ccy_jpy",
        CANDIDATE_REF,
    )?;
    // Under <data>/model: the one directory the service registers artifacts from.
    let saved = artifact::save(&data.join("model").join("candidate"), &spec, &weights)?;
    let path = saved
        .weights_path
        .to_str()
        .context("the data dir's path is not UTF-8")?
        .to_owned();
    Ok((path, saved.digest))
}

async fn connect(grpc: &str, data: &Path, member: &str) -> anyhow::Result<ClearingClient> {
    let layout = PkiLayout::new(data);
    let mut client = ClearingClient::connect(
        grpc,
        &TlsPaths::client(&layout, Role::Member, member),
        &data.join("keys").join("envelope.pub.pem"),
        member,
    )
    .await
    .with_context(|| format!("cannot connect as {member}"))?;
    client.key_exchange().await?;
    Ok(client)
}

/// One member's trades, about one a second, until told to stop; after the shift, four in
/// five are in yen.
async fn submit_loop(
    mut client: ClearingClient,
    member: String,
    seed: u64,
    yen: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
) {
    let mut rng = SplitMix(seed);
    let date = value_date();
    let mut n = 0u64;
    // A random start, so that the members do not trade in step.
    tokio::time::sleep(jittered(&mut rng)).await;
    while !stop.load(Ordering::Relaxed) {
        let mut request = trade_request(&mut rng, &member, &date);
        if yen.load(Ordering::Relaxed)
            && rng.below(5) != 0
            && let Some(trade) = request.trade.as_mut()
        {
            trade.currency = "JPY".into();
        }
        n += 1;
        match client.submit(&format!("demo-{seed}-{n}"), &request).await {
            Ok(_) => {
                sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(member, error = %e, "a demo trade was refused"),
        }
        tokio::time::sleep(jittered(&mut rng)).await;
    }
}

/// A pause of 0.5 to 1.5 times [`MEMBER_PAUSE`].
fn jittered(rng: &mut SplitMix) -> Duration {
    MEMBER_PAUSE.mul_f64(0.5 + rng.unit())
}

/// Issues the demo members' client certificates from the CA `aether serve` created.
fn issue_member_certs(data: &Path) -> anyhow::Result<Vec<String>> {
    let members: Vec<String> = (1..=DEMO_MEMBERS)
        .map(|i| format!("demo-member-{i:02}"))
        .collect();
    let spec = DevPkiSpec {
        members: members.clone(),
        workers: Vec::new(),
        ..DevPkiSpec::default()
    };
    init_dev_pki(data, &spec).context("cannot issue the demo members' certificates")?;
    Ok(members)
}

/// One timeline line for a controller event worth showing.
fn describe(event: &Value) -> Option<String> {
    let p = &event["payload"];
    let seq = event["seq"].as_u64().unwrap_or(0);
    let line = match event["event_type"].as_str()? {
        "RolloutWeightSet" => format!(
            "candidate weight {}% -> {}% ({})",
            p["from_weight"],
            p["to_weight"],
            p["reason"].as_str().unwrap_or("")
        ),
        "RolloutAssessed" => format!(
            "window checked: risk {:.2} ({}), candidate p99 {:.1} ms, agreement {:.2}",
            p["risk"]["risk"].as_f64().unwrap_or(f64::NAN),
            p["risk"]["decision"].as_str().unwrap_or("?"),
            p["metrics"]["candidate"]["latency_p99_us"]
                .as_f64()
                .unwrap_or(f64::NAN)
                / 1000.0,
            p["metrics"]["agreement"]["jaccard"]
                .as_f64()
                .unwrap_or(f64::NAN),
        ),
        "DriftAssessed" if p["tier"] != "l1" => format!(
            "drift {:.2}: tier {} -> {}",
            p["report"]["score"].as_f64().unwrap_or(f64::NAN),
            p["tier"].as_str().unwrap_or("?"),
            p["response"].as_str().unwrap_or("?")
        ),
        "ReviewTicketOpened" => format!(
            "review ticket {} opened",
            p["ticket"].as_str().unwrap_or("?")
        ),
        "RetrainRequested" => "retrain of the candidate requested".to_owned(),
        "ControllerTransitioned" => format!(
            "controller {} -> {}: {}",
            p["from"].as_str().unwrap_or("?"),
            p["to"].as_str().unwrap_or("?"),
            p["reason"].as_str().unwrap_or("")
        ),
        "AnalysisPaused" => format!(
            "analysis paused the rollout ({})",
            p["reason"].as_str().unwrap_or("?")
        ),
        "SemanticRollbackDecided" => format!(
            "semantic rollback decided: {}",
            p["reason"].as_str().unwrap_or("")
        ),
        "RolledBack" => format!(
            "RolledBack to snapshot {} (routing, rules and corpus in one event)",
            p["target_snapshot"].as_str().unwrap_or("?")
        ),
        "StepSnapshotTaken" => format!(
            "snapshot {} taken at step {}",
            p["snapshot_id"].as_str().unwrap_or("?"),
            p["step"]
        ),
        "RolloutPromoted" => "candidate promoted to 100%".to_owned(),
        "RolloutAborted" => "rollout aborted".to_owned(),
        _ => return None,
    };
    Some(format!("{line}  [seq {seq}]"))
}

/// The operator and regulator tokens from the `tokens` file the service created.
fn read_tokens(path: &Path) -> anyhow::Result<(String, String)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the tokens file {}", path.display()))?;
    let token = |role: &str| {
        text.lines()
            .filter_map(|l| l.trim().split_once(':'))
            .find(|(r, _)| *r == role)
            .map(|(_, t)| t.to_owned())
            .with_context(|| format!("no {role} token in {}", path.display()))
    };
    Ok((token("operator")?, token("regulator")?))
}
