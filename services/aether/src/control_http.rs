//! The control plane's HTTP surface built so far: policy ingest and listing.

use aether_control::{
    ActivationRequest, Command, EngineError, IngestError, ModelError, ModelSpec, RolloutError,
    RolloutRequest,
};
use aether_rules::{PolicyError, PolicyFormat};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use crate::auth::Role;
use aether_control::Origin;
use axum::Extension;

use crate::http::{AppState, Problem, authorize, origin_of};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/policy/ingest", post(ingest))
        .route("/v1/policies", get(list))
        .route("/v1/policies/{name}/versions", get(versions))
        .route("/v1/models", post(register_model).get(list_models))
        .route("/v1/engine/activate", post(activate))
        .route("/v1/engines", get(list_engines))
        .route("/v1/engines/{region}", get(engine))
        .route("/v1/rollouts", post(start_rollout).get(list_rollouts))
        .route("/v1/rollouts/{id}", get(rollout))
        .route("/v1/rollouts/{id}/{command}", post(rollout_command))
        .route("/v1/state", get(control_state))
}

/// `GET /v1/state`: the projected control-plane state and its SM3 digest, to compare with
/// `aether replay`.
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
async fn start_rollout(
    State(state): State<AppState>,
    Extension(origin): Extension<Origin>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, &[Role::Operator])?;
    let origin = origin_of(&state, &origin, &caller);
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
async fn rollout_command(
    State(state): State<AppState>,
    Extension(origin): Extension<Origin>,
    headers: HeaderMap,
    Path((id, command)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, Problem> {
    #[derive(serde::Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct Options {
        expected_version: Option<u64>,
        reason: Option<String>,
    }
    let caller = authorize(&state, &headers, &[Role::Operator])?;
    let origin = origin_of(&state, &origin, &caller);
    let command: Command = command.parse().map_err(|e: RolloutError| {
        Problem::new(StatusCode::NOT_FOUND, "Unknown command", e.to_string())
    })?;
    let options: Options = if body.is_empty() {
        Options::default()
    } else {
        json_body(&body, "command options {expected_version, reason}")?
    };
    let (rollout, event) = state
        .control
        .rollouts
        .command(
            &id,
            command,
            options.expected_version,
            options.reason.as_deref(),
            &origin,
        )
        .await
        .map_err(rollout_problem)?;
    Ok(axum::Json(json!({ "rollout": rollout, "event": event })).into_response())
}

async fn list_rollouts(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    Ok(axum::Json(json!({ "rollouts": state.control.rollouts.all() })).into_response())
}

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
        .ok_or_else(|| {
            Problem::new(
                StatusCode::NOT_FOUND,
                "Not found",
                format!("no rollout {id:?}"),
            )
        })
}

pub(crate) fn json_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> Result<T, Problem> {
    serde_json::from_slice(body).map_err(|e| {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid request",
            format!("the body is not a valid {what}: {e}"),
        )
    })
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
async fn register_model(
    State(state): State<AppState>,
    Extension(origin): Extension<Origin>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, &[Role::Operator])?;
    let origin = origin_of(&state, &origin, &caller);
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

async fn list_models(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    Ok(axum::Json(json!({ "models": state.control.models.all() })).into_response())
}

/// `POST /v1/engine/activate` (operator): 202 with the request event; the steps follow.
async fn activate(
    State(state): State<AppState>,
    Extension(origin): Extension<Origin>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, &[Role::Operator])?;
    let origin = origin_of(&state, &origin, &caller);
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

async fn list_engines(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    Ok(axum::Json(json!({ "engines": state.control.engines.engines() })).into_response())
}

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
async fn ingest(
    State(state): State<AppState>,
    Extension(origin): Extension<Origin>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, &[Role::Operator])?;
    let origin = origin_of(&state, &origin, &caller);
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
