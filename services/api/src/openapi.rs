//! The OpenAPI 3.1 document served at `/v1/openapi.json`, generated from the handlers'
//! `#[utoipa::path]` attributes while the documented routers are built
//! (`utoipa_axum::OpenApiRouter`), so a route cannot exist without its entry.
//!
//! What every operation shares is added here once rather than on each handler: the
//! bearer-token security requirement, the 400 / 401 / 403 answers, and
//! `application/problem+json` (RFC 9457) as the body of every error.

use utoipa::openapi::path::Operation;
use utoipa::openapi::schema::{Schema, SchemaType, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, Response, ResponseBuilder};
use utoipa::{Modify, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;

use crate::state::AppState;

/// Where the document is served.
pub const PATH: &str = "/v1/openapi.json";

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Aether",
        description = "Event-sourced compliance and lineage service for a clearing engine. \
            Every change is an append-only, SM3 hash-chained ledger event. Callers present a \
            bearer token of role operator, regulator or worker; each operation says which.",
    ),
    components(schemas(ProblemDocument)),
    tags(
        (name = "policies", description = "Compliance policies in CEL, hot-loaded"),
        (name = "models", description = "The model registry"),
        (name = "engines", description = "Engine activation per region"),
        (name = "rollouts", description = "Progressive rollouts of a candidate model"),
        (name = "corpora", description = "The versioned regulatory corpus"),
        (name = "snapshots", description = "Consistent snapshots of routing, rules and corpus, and rollback"),
        (name = "state", description = "The projected control-plane state"),
        (name = "ledger", description = "The event ledger: append, read, redact a personal value, an event's lineage records"),
        (name = "lineage", description = "The Marquez-compatible lineage API: OpenLineage events from other producers in, and Aether's own lineage joined with them out, in Marquez's shapes (its clients work unchanged); `asOf` on the graph is Aether's"),
        (name = "console", description = "Console sessions: a token exchanged once for an HttpOnly session cookie, sign-out, page views"),
        (name = "audit", description = "The regulator's read-only audit API: filtered events, proofs, signed checkpoints, state as of any point, decision explanations, evidence bundles"),
    )
)]
pub struct ApiDoc;

/// A router whose routes are documented as they are added.
pub fn documented() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
}

/// The axum router and its finished document (shared parts added).
pub fn split(
    router: OpenApiRouter<AppState>,
) -> (axum::Router<AppState>, utoipa::openapi::OpenApi) {
    let (router, mut doc) = router.split_for_parts();
    Shared.modify(&mut doc);
    (router, doc)
}

/// RFC 9457 problem details: the body of every error answer.
#[derive(ToSchema)]
#[schema(as = Problem)]
#[allow(dead_code)] // documents the wire format; `http::Problem` writes it
pub struct ProblemDocument {
    /// Always `about:blank`.
    r#type: String,
    title: String,
    status: u16,
    /// What was wrong, precisely enough to fix the request.
    detail: String,
}

/// Adds what every operation shares (see the module documentation).
struct Shared;

impl Modify for Shared {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A role token from AETHER_TOKENS or the data dir's `tokens` file",
                    ))
                    .build(),
            ),
        );
        for item in doc.paths.paths.values_mut() {
            let operations = [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.delete,
                &mut item.patch,
            ];
            for operation in operations.into_iter().flatten() {
                share(operation);
            }
        }
    }
}

/// What no path or query parameter may hold: NUL (refused by the `refuse_nul` middleware before any
/// handler, as the database could not store it).
pub(crate) const NO_NUL: &str = "^[^\\x00]*$";

fn share(operation: &mut Operation) {
    for parameter in operation.parameters.iter_mut().flatten() {
        if let Some(RefOr::T(Schema::Object(object))) = parameter.schema.as_mut()
            && object.schema_type == SchemaType::Type(Type::String)
            && object.pattern.is_none()
        {
            object.pattern = Some(NO_NUL.to_owned());
        }
    }
    operation
        .security
        .get_or_insert_with(Vec::new)
        .push(SecurityRequirement::new("bearer", Vec::<String>::new()));
    let responses = &mut operation.responses.responses;
    for (status, description) in [
        ("400", "Malformed request or traffic-colouring header"),
        ("401", "Missing or unknown bearer token"),
        ("403", "The token's role may not call this operation"),
    ] {
        responses
            .entry(status.to_owned())
            .or_insert_with(|| RefOr::T(ResponseBuilder::new().description(description).build()));
    }
    for (status, response) in responses.iter_mut() {
        if status.parse::<u16>().is_ok_and(|s| s >= 400)
            && let RefOr::T(response) = response
        {
            as_problem(response);
        }
    }
}

fn as_problem(response: &mut Response) {
    response.content.clear();
    response.content.insert(
        "application/problem+json".to_owned(),
        ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("Problem")))
            .build(),
    );
}
