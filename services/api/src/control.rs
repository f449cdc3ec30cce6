//! The control plane's HTTP surface: policies, models, engines, rollouts and the state
//! digest, each handler documented for the OpenAPI document.

use aether_control::{
    ActivationRequest, Command, EngineError, IngestError, ModelError, ModelSpec, RolloutError,
    RolloutRequest,
};
use aether_ledger::RecordedEvent;
use aether_rules::{PolicyError, PolicyFormat};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::Role;

use crate::access::{Operator, authorize};
use crate::params::json_body;
use crate::problem::Problem;
use crate::state::AppState;

/// The control plane's documented routes (see the `openapi` module).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(ingest))
        .routes(routes!(list))
        .routes(routes!(versions))
        .routes(routes!(register_model, list_models))
        .routes(routes!(activate))
        .routes(routes!(list_engines))
        .routes(routes!(engine))
        .routes(routes!(start_rollout, list_rollouts))
        .routes(routes!(rollout))
        .routes(routes!(rollout_analysis))
        .routes(routes!(close_review))
        .routes(routes!(rollout_command))
        .routes(routes!(control_state))
}

/// `GET /v1/state`: the projected control-plane state and its SM3 digest, to compare with
/// `aether replay`.
#[utoipa::path(get, path = "/v1/state", tag = "state",
    description = "The projected control-plane state and its SM3 digest (compare with `aether replay`). Role: operator or regulator.",
    responses((status = 200, description = "`{digest, state}`", body = serde_json::Value)))]
async fn control_state(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    Ok(axum::Json(json!({
        "digest": state.control.digest(),
        "state": state.control.document(),
    }))
    .into_response())
}

fn rollout_problem(e: RolloutError) -> Problem {
    match e {
        RolloutError::Model(e) => model_problem(e),
        RolloutError::Ledger(e) => e.into(),
        e @ RolloutError::NotFound(_) => {
            Problem::new(StatusCode::NOT_FOUND, "Not found", e.to_string())
        }
        e @ (RolloutError::InvalidTransition { .. }
        | RolloutError::Stale { .. }
        | RolloutError::RegionBusy { .. }) => {
            Problem::new(StatusCode::CONFLICT, "Rollout conflict", e.to_string())
        }
        e => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid rollout",
            e.to_string(),
        ),
    }
}

/// `POST /v1/rollouts` (operator): `{baseline, candidate, steps?, analysis?}`.
#[utoipa::path(post, path = "/v1/rollouts", tag = "rollouts", request_body = RolloutRequest,
    description = "Starts a rollout of `candidate` against `baseline` (one region), recording `RolloutStarted`. Role: operator.",
    responses(
        (status = 201, description = "`{rollout, event}`", body = serde_json::Value),
        (status = 409, description = "Another rollout is in progress in the region"),
        (status = 422, description = "Unknown model, models of two regions, or bad steps")))]
async fn start_rollout(
    State(state): State<AppState>,
    Operator(origin): Operator,
    body: Bytes,
) -> Result<Response, Problem> {
    let request: RolloutRequest =
        json_body(&body, "rollout {baseline, candidate, steps, analysis}")?;
    let (rollout, event) = state
        .control
        .rollouts
        .start(request, &origin)
        .await
        .map_err(rollout_problem)?;
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({ "rollout": rollout, "event": event })),
    )
        .into_response())
}

/// `POST /v1/rollouts/{id}/{step|pause|resume|promote|abort}` (operator), optional body
/// `{expected_version, reason}`.
#[utoipa::path(post, path = "/v1/rollouts/{id}/{command}", tag = "rollouts",
    description = "Applies `step`, `pause`, `resume`, `promote` or `abort` if the state machine allows it; optional body `{expected_version, reason, duration_ms}` (409 when stale; `duration_ms` with pause resumes by itself). Role: operator.",
    params(("id" = String, Path, description = "Rollout id"),
           ("command" = String, Path, description = "step | pause | resume | promote | abort")),
    request_body(content = serde_json::Value, description = "Optional `{expected_version, reason, duration_ms}`"),
    responses(
        (status = 200, description = "`{rollout, event}`", body = serde_json::Value),
        (status = 404, description = "No such rollout or command"),
        (status = 409, description = "Not allowed in the rollout's phase, or a stale expected_version")))]
async fn rollout_command(
    State(state): State<AppState>,
    Operator(origin): Operator,
    Path((id, command)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, Problem> {
    #[derive(serde::Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct Options {
        expected_version: Option<u64>,
        reason: Option<String>,
        /// With `pause`: resume by itself after this long.
        duration_ms: Option<u64>,
    }
    /// A week: longer pauses are indefinite ones (resume by hand).
    const MAX_PAUSE_MS: u64 = 7 * 24 * 3600 * 1000;
    let command: Command = command.parse().map_err(|e: RolloutError| {
        Problem::new(StatusCode::NOT_FOUND, "Unknown command", e.to_string())
    })?;
    let options: Options = if body.is_empty() {
        Options::default()
    } else {
        json_body(&body, "command options {expected_version, reason}")?
    };
    let rollouts = &state.control.rollouts;
    let (rollout, event) = match (command, options.duration_ms) {
        (_, None) => {
            rollouts
                .command(
                    &id,
                    command,
                    options.expected_version,
                    options.reason.as_deref(),
                    &origin,
                )
                .await
        }
        (Command::Pause, Some(ms @ 1..=MAX_PAUSE_MS)) => {
            let until = chrono::Utc::now() + chrono::TimeDelta::milliseconds(ms as i64);
            rollouts
                .pause_until(
                    &id,
                    until,
                    options.expected_version,
                    options.reason.as_deref(),
                    &origin,
                )
                .await
        }
        (Command::Pause, Some(ms)) => {
            return Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid pause",
                format!("duration_ms must be 1..={MAX_PAUSE_MS}, got {ms}"),
            ));
        }
        (_, Some(_)) => {
            return Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid command",
                "duration_ms applies to pause only",
            ));
        }
    }
    .map_err(rollout_problem)?;
    Ok(axum::Json(json!({ "rollout": rollout, "event": event })).into_response())
}

#[utoipa::path(get, path = "/v1/rollouts", tag = "rollouts",
    description = "Every rollout with its phase, step and candidate weight. Role: operator or regulator.",
    responses((status = 200, description = "`{rollouts: [...]}`", body = serde_json::Value)))]
async fn list_rollouts(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    Ok(axum::Json(json!({ "rollouts": state.control.rollouts.all() })).into_response())
}

#[utoipa::path(get, path = "/v1/rollouts/{id}", tag = "rollouts",
    description = "One rollout. Role: operator or regulator.",
    params(("id" = String, Path, description = "Rollout id")),
    responses((status = 200, description = "The rollout", body = serde_json::Value),
              (status = 404, description = "No such rollout")))]
async fn rollout(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    state
        .control
        .rollouts
        .get(&id)
        .map(|r| axum::Json(r).into_response())
        .ok_or_else(|| no_rollout(&id))
}

/// Rollout checks read per page of the analysis stream; a check is about ten events.
const ANALYSIS_PAGE: u32 = 500;
/// Pages read at most for one answer, so a long rollout cannot make it unbounded.
const ANALYSIS_PAGES: usize = 20;

#[utoipa::path(get, path = "/v1/rollouts/{id}/analysis", tag = "rollouts",
    description = "The rollout's newest analysis checks (newest first), each with its window, step, evidence and the A/B significance of the candidate against the baseline (Wilcoxon signed-rank and Cliff's delta per golden metric over the paired windows; ANALYSIS.md); `significance` is the newest conclusive check's. Role: operator or regulator.",
    params(("id" = String, Path, description = "Rollout id"),
           ("limit" = Option<u64>, Query, minimum = 1, maximum = 100, description = "Checks to return, 1 to 100 (default 20)")),
    responses((status = 200, description = "`{rollout, checks: [{seq, window_start, window_end, step, gate, weight, evidence?, significance?, metrics?, risk?, missing?, drift?: {tier, response, score, composite_score}}], significance}`: `metrics` (the golden metrics of the window) and `risk` from the check's `RolloutAssessed` (or `metrics` and `missing` from its `AnalysisInconclusive`), `drift` from its `DriftAssessed`", body = serde_json::Value),
              (status = 400, description = "A malformed parameter or one out of its range"),
              (status = 404, description = "No such rollout")))]
async fn rollout_analysis(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    query: crate::params::Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let p = crate::params::params(query, &["limit"])?;
    let limit = crate::params::parse_u64(&p, "limit", 20)?;
    if !(1..=100).contains(&limit) {
        return Err(Problem::bad_request(format!(
            "limit must be between 1 and 100, got {limit}"
        )));
    }
    let rollout = state
        .control
        .rollouts
        .get(&id)
        .ok_or_else(|| no_rollout(&id))?;
    let stream = aether_control::rollout_controller::stream(&id);
    let checks: Vec<serde_json::Value> = newest_checks(&state.reads, &stream, limit as usize)
        .await?
        .iter()
        .map(|(check, outcomes)| check_summary(check, outcomes))
        .collect();
    let significance = checks
        .iter()
        .find_map(|c| c.get("significance").cloned())
        .unwrap_or(serde_json::Value::Null);
    Ok(axum::Json(json!({
        "rollout": rollout,
        "checks": checks,
        "significance": significance,
    }))
    .into_response())
}

/// The body of a review's close.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReviewClose {
    /// What the reviewers decided: 1 to 2,000 characters, not only spaces.
    #[schema(pattern = "^[^\\x00]*\\S[^\\x00]*$", max_length = 2000)]
    resolution: String,
}

#[utoipa::path(post, path = "/v1/rollouts/{id}/reviews/{ticket}/close", tag = "rollouts",
    description = "Closes the drift review an L3 freeze opened (`ReviewTicketClosed` on the rollout's stream, body `{resolution}`): the rollout controller releases the freeze and the candidate starts again from its first step. Role: operator.",
    params(("id" = String, Path, description = "Rollout id"),
           ("ticket" = String, Path, description = "The open review's ticket, as `ReviewTicketOpened` names it")),
    request_body(content = ReviewClose, description = "What the reviewers decided"),
    responses(
        (status = 200, description = "`{rollout, event}`", body = serde_json::Value),
        (status = 404, description = "No such rollout"),
        (status = 409, description = "No review is open, the ticket is not the open one, or it is closed already"),
        (status = 422, description = "No resolution")))]
async fn close_review(
    State(state): State<AppState>,
    Operator(origin): Operator,
    Path((id, ticket)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, Problem> {
    let close: ReviewClose = json_body(&body, "review close {resolution}")?;
    if close.resolution.trim().is_empty() || close.resolution.chars().count() > 2000 {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid resolution",
            "resolution must say what was decided, 1 to 2,000 characters",
        ));
    }
    if state.control.rollouts.get(&id).is_none() {
        return Err(no_rollout(&id));
    }
    let conflict =
        |detail: String| Problem::new(StatusCode::CONFLICT, "No such open review", detail);
    let analysis = aether_control::rollout_controller::stream(&id);
    let opened = newest_of_type(
        &state.store,
        &analysis,
        aether_control::rollout_controller::REVIEW_OPENED,
        1,
    )
    .await?
    .into_iter()
    .next()
    .ok_or_else(|| conflict(format!("rollout {id} has no review open")))?;
    let open_ticket = serde_json::from_str::<serde_json::Value>(opened.payload.get())
        .ok()
        .and_then(|p| p["ticket"].as_str().map(str::to_owned))
        .unwrap_or_default();
    if open_ticket != ticket {
        return Err(conflict(format!(
            "the newest review of rollout {id} is {open_ticket:?}, not {ticket:?}"
        )));
    }
    let rollout_stream = format!("rollout/{id}");
    if let Some(closed) = newest_of_type(
        &state.store,
        &rollout_stream,
        aether_control::rollouts::REVIEW_CLOSED,
        1,
    )
    .await?
    .into_iter()
    .next()
        && serde_json::from_str::<serde_json::Value>(closed.payload.get())
            .is_ok_and(|p| p["ticket"] == ticket.as_str())
    {
        return Err(conflict(format!("review {ticket} is closed already")));
    }
    let (rollout, event) = state
        .control
        .rollouts
        .close_review(&id, &ticket, close.resolution.trim(), &origin)
        .await
        .map_err(rollout_problem)?;
    Ok(axum::Json(json!({ "rollout": rollout, "event": event })).into_response())
}

/// Reads `stream` newest first, a page at a time, at most [`ANALYSIS_PAGES`] pages, while
/// `visit` asks for more.
async fn walk_back(
    store: &aether_ledger::EventStore,
    stream: &str,
    mut visit: impl FnMut(&RecordedEvent) -> bool,
) -> Result<(), Problem> {
    let mut before = u64::MAX;
    for _ in 0..ANALYSIS_PAGES {
        let page = store
            .read_stream(
                stream,
                before,
                aether_ledger::Direction::Backward,
                ANALYSIS_PAGE,
            )
            .await?;
        for event in &page {
            if !visit(event) {
                return Ok(());
            }
        }
        match page.last() {
            Some(last) if last.stream_version > 1 => before = last.stream_version - 1,
            _ => break,
        }
    }
    Ok(())
}

/// The newest `limit` events of `event_type` on `stream`, newest first.
async fn newest_of_type(
    store: &aether_ledger::EventStore,
    stream: &str,
    event_type: &str,
    limit: usize,
) -> Result<Vec<RecordedEvent>, Problem> {
    let mut found = Vec::new();
    walk_back(store, stream, |event| {
        if event.event_type == event_type {
            found.push(event.clone());
        }
        found.len() < limit
    })
    .await?;
    Ok(found)
}

/// The newest `limit` checks on `stream`, newest first, each with the outcomes recorded
/// with it (`RolloutAssessed`, `AnalysisInconclusive`, `DriftAssessed`: a check appends its
/// outcomes and then its `RolloutChecked` in one append, so they are the events just before
/// it).
async fn newest_checks(
    store: &aether_ledger::EventStore,
    stream: &str,
    limit: usize,
) -> Result<Vec<(RecordedEvent, Vec<RecordedEvent>)>, Problem> {
    use aether_control::rollout_controller::{ASSESSED, CHECKED, DRIFT_ASSESSED, INCONCLUSIVE};
    let mut checks: Vec<(RecordedEvent, Vec<RecordedEvent>)> = Vec::new();
    walk_back(store, stream, |event| {
        if event.event_type == CHECKED {
            // One check more than asked bounds the outcomes of the last one asked.
            if checks.len() == limit {
                return false;
            }
            checks.push((event.clone(), Vec::new()));
        } else if [ASSESSED, INCONCLUSIVE, DRIFT_ASSESSED].contains(&event.event_type.as_str())
            && let Some((_, outcomes)) = checks.last_mut()
        {
            outcomes.push(event.clone());
        }
        true
    })
    .await?;
    Ok(checks)
}

/// A `RolloutChecked` without the analyzer's internals (its state's samples), with the
/// golden metrics, risk and drift its outcomes recorded.
fn check_summary(event: &RecordedEvent, outcomes: &[RecordedEvent]) -> serde_json::Value {
    let p: serde_json::Value =
        serde_json::from_str(event.payload.get()).unwrap_or(serde_json::Value::Null);
    let mut summary = json!({
        "seq": event.seq,
        "recorded_at": event.recorded_at,
        "window_start": p["window_start"],
        "window_end": p["window_end"],
        "step": p["step"],
        "gate": p["state"]["gate"],
        "weight": p["state"]["weight"],
        "controller": p["state"]["controller"]["mode"],
    });
    for member in ["evidence", "significance"] {
        if let Some(v) = p.get(member) {
            summary[member] = v.clone();
        }
    }
    for outcome in outcomes {
        let o: serde_json::Value =
            serde_json::from_str(outcome.payload.get()).unwrap_or(serde_json::Value::Null);
        if outcome.event_type == aether_control::rollout_controller::DRIFT_ASSESSED {
            summary["drift"] = json!({
                "tier": o["tier"],
                "response": o["response"],
                "score": o["report"]["score"],
                "composite_score": o["report"]["composite"]["score"],
            });
        } else {
            for member in ["metrics", "risk", "missing"] {
                if let Some(v) = o.get(member) {
                    summary[member] = v.clone();
                }
            }
        }
    }
    summary
}

/// 404 for a rollout id the projection does not know.
fn no_rollout(id: &str) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        "Not found",
        format!("no rollout {id:?}"),
    )
}

fn model_problem(e: ModelError) -> Problem {
    match e {
        ModelError::Ledger(e) => e.into(),
        e @ ModelError::AlreadyRegistered(_) => Problem::new(
            StatusCode::CONFLICT,
            "Model already registered",
            e.to_string(),
        ),
        e => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid model",
            e.to_string(),
        ),
    }
}

/// `POST /v1/models` (operator): `{ref, uri, digest, feature_schema}` → `ModelRegistered`.
#[utoipa::path(post, path = "/v1/models", tag = "models", request_body = ModelSpec,
    description = "Registers a model artifact (`ModelRegistered`); registering the same spec again changes nothing. Role: operator.",
    responses(
        (status = 201, description = "`{model, event}`", body = serde_json::Value),
        (status = 200, description = "Already registered with this spec: `{model, event: null}`", body = serde_json::Value),
        (status = 409, description = "The ref is registered with another spec"),
        (status = 422, description = "Bad ref, digest or feature schema, or an unreadable artifact")))]
async fn register_model(
    State(state): State<AppState>,
    Operator(origin): Operator,
    body: Bytes,
) -> Result<Response, Problem> {
    let spec: ModelSpec = json_body(
        &body,
        "model registration {ref, uri, digest, feature_schema}",
    )?;
    match state.control.models.register(spec.clone(), &origin).await {
        Ok(Some(event)) => Ok((
            StatusCode::CREATED,
            axum::Json(json!({ "model": spec, "event": event })),
        )
            .into_response()),
        Ok(None) => Ok(axum::Json(json!({ "model": spec, "event": null })).into_response()),
        Err(e) => Err(model_problem(e)),
    }
}

#[utoipa::path(get, path = "/v1/models", tag = "models",
    description = "Every registered model. Role: operator or regulator.",
    responses((status = 200, description = "`{models: [...]}`", body = serde_json::Value)))]
async fn list_models(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    Ok(axum::Json(json!({ "models": state.control.models.all() })).into_response())
}

/// `POST /v1/engine/activate` (operator): 202 with the request event; the steps follow.
#[utoipa::path(post, path = "/v1/engine/activate", tag = "engines", request_body = ActivationRequest,
    description = "Records `EngineActivationRequested` and answers at once; the artifact check, policy binding and circuit breaker follow as events, ending in `EngineActivated` or `EngineActivationFailed`. Role: operator.",
    responses(
        (status = 202, description = "`{event, status_url}`; `Location` names the engine", body = serde_json::Value),
        (status = 409, description = "The region is already activating"),
        (status = 422, description = "Unknown model, weight outside (0, 1], or a bad hook")))]
async fn activate(
    State(state): State<AppState>,
    Operator(origin): Operator,
    body: Bytes,
) -> Result<Response, Problem> {
    let request: ActivationRequest = json_body(
        &body,
        "activation {model_ref, traffic_weight, policy_hooks}",
    )?;
    match state
        .control
        .engines
        .request_activation(request, &origin)
        .await
    {
        Ok((event, _task)) => {
            let region = event.stream_id.trim_start_matches("engine/").to_owned();
            Ok((
                StatusCode::ACCEPTED,
                [(header::LOCATION, format!("/v1/engines/{region}"))],
                axum::Json(json!({
                    "event": event,
                    "status_url": format!("/v1/engines/{region}"),
                })),
            )
                .into_response())
        }
        Err(EngineError::Model(e)) => Err(model_problem(e)),
        Err(EngineError::Ledger(e)) => Err(e.into()),
        Err(e @ (EngineError::Busy { .. } | EngineError::Conflict { .. })) => Err(Problem::new(
            StatusCode::CONFLICT,
            "Engine busy",
            e.to_string(),
        )),
        Err(e) => Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid activation",
            e.to_string(),
        )),
    }
}

#[utoipa::path(get, path = "/v1/engines", tag = "engines",
    description = "Every engine by region. Role: operator or regulator.",
    responses((status = 200, description = "`{engines: [...]}`", body = serde_json::Value)))]
async fn list_engines(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    Ok(axum::Json(json!({ "engines": state.control.engines.engines() })).into_response())
}

#[utoipa::path(get, path = "/v1/engines/{region}", tag = "engines",
    description = "One region's engine with its activation steps. Role: operator or regulator.",
    params(("region" = String, Path, description = "Region")),
    responses((status = 200, description = "The engine", body = serde_json::Value),
              (status = 404, description = "No engine in the region")))]
async fn engine(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(region): Path<String>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    match state.control.engines.engine(&region) {
        Some(e) => Ok(axum::Json(e).into_response()),
        None => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "Not found",
            format!("no engine in region {region:?}"),
        )),
    }
}

fn format_of(headers: &HeaderMap) -> Result<PolicyFormat, Problem> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match content_type.as_str() {
        "application/json" => Ok(PolicyFormat::Json),
        "application/yaml" | "application/x-yaml" | "text/yaml" => Ok(PolicyFormat::Yaml),
        other => Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Unsupported policy format",
            format!(
                "Content-Type {other:?} is not a policy format; use application/json or application/yaml"
            ),
        )),
    }
}

/// `POST /v1/policy/ingest` (operator): a policy document as JSON or YAML.
#[utoipa::path(post, path = "/v1/policy/ingest", tag = "policies",
    description = "Compiles and type-checks a CEL policy (JSON or YAML by Content-Type) and hot-loads it as a new version (`PolicyIngested`); a refusal is recorded as `PolicyIngestRejected` and changes nothing else. Role: operator.",
    request_body(content = String, content_type = "application/yaml", description = "The policy document (application/json also accepted)"),
    responses(
        (status = 201, description = "`{policy, event}`", body = serde_json::Value),
        (status = 200, description = "This version was already ingested with the same digest", body = serde_json::Value),
        (status = 409, description = "The version exists with another digest"),
        (status = 415, description = "Not application/json or application/yaml"),
        (status = 422, description = "Invalid policy: the problem names the rule, line and column")))]
async fn ingest(
    State(state): State<AppState>,
    Operator(origin): Operator,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Problem> {
    let format = format_of(&headers)?;
    let source = std::str::from_utf8(&body)
        .map_err(|e| Problem::bad_request(format!("the policy document is not UTF-8: {e}")))?;
    match state.control.policies.ingest(source, format, &origin).await {
        Ok((record, Some(event))) => Ok((
            StatusCode::CREATED,
            axum::Json(json!({ "policy": record, "event": event })),
        )
            .into_response()),
        Ok((record, None)) => Ok(axum::Json(json!({
            "policy": record,
            "event": null,
            "note": "this version was already ingested with the same digest; nothing changed",
        }))
        .into_response()),
        Err(IngestError::Invalid(e)) => Err(invalid_policy(&e)),
        Err(e @ (IngestError::VersionExists { .. } | IngestError::Conflict { .. })) => {
            Err(Problem::new(
                StatusCode::CONFLICT,
                "Policy version conflict",
                e.to_string(),
            ))
        }
        Err(IngestError::Ledger(e)) => Err(e.into()),
    }
}

/// 422 with the rule, line and column when the compiler gave them.
fn invalid_policy(e: &PolicyError) -> Problem {
    let mut problem = Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid policy",
        e.to_string(),
    );
    let (rule_id, position) = match e {
        PolicyError::Syntax {
            rule_id, position, ..
        }
        | PolicyError::UnknownIdentifier {
            rule_id, position, ..
        } => (Some(rule_id), *position),
        _ => (None, None),
    };
    if let Some(rule_id) = rule_id {
        problem = problem.with("rule_id", json!(rule_id));
    }
    if let Some(p) = position {
        problem = problem
            .with("line", json!(p.line))
            .with("column", json!(p.column));
    }
    problem
}

/// `GET /v1/policies`: every policy, its active version and how many versions it has.
#[utoipa::path(get, path = "/v1/policies", tag = "policies",
    description = "Every policy with its active version, and the digest of the rule set in force. Role: operator or regulator.",
    responses((status = 200, description = "`{policies, rule_set_digest}`", body = serde_json::Value)))]
async fn list(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let policies: Vec<_> = state
        .control.policies
        .policies()
        .into_iter()
        .map(|(name, versions)| {
            json!({ "name": name, "active": versions.last(), "versions": versions.len() })
        })
        .collect();
    Ok(axum::Json(json!({
        "policies": policies,
        "rule_set_digest": hex::encode(state.control.policies.engine().snapshot().digest()),
    }))
    .into_response())
}

/// `GET /v1/policies/{name}/versions`: one policy's versions, oldest first.
#[utoipa::path(get, path = "/v1/policies/{name}/versions", tag = "policies",
    description = "One policy's versions, oldest first. Role: operator or regulator.",
    params(("name" = String, Path, description = "Policy name")),
    responses((status = 200, description = "`{name, versions}`", body = serde_json::Value),
              (status = 404, description = "No policy of that name")))]
async fn versions(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    match state.control.policies.versions(&name) {
        Some(v) => Ok(axum::Json(json!({ "name": name, "versions": v })).into_response()),
        None => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "Not found",
            format!("no policy named {name:?}"),
        )),
    }
}
