//! The opened payload of a clearing call, decoded and checked before anything is looked up
//! or batched. Pure functions of the bytes, so that the property tests
//! (`tests/request_props.rs`) and the coverage-guided fuzz targets (`fuzz/`) reach the
//! very code the gRPC service runs.

use prost::Message;

use crate::clearing::{ClearError, Colouring, Submission, TradeInput};
use crate::pb::v1::{self as pb, ClearingRequest};

/// Why an opened payload is not a clearing request; answered INVALID_ARGUMENT.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("the opened payload is not a ClearingRequest: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("the ClearingRequest has no trade")]
    NoTrade,
}

/// A decoded request: its colouring fields, and the trade taken out of it.
#[derive(Debug)]
pub struct Opened {
    pub request: ClearingRequest,
    pub trade: pb::Trade,
}

/// Decodes the plaintext of an opened envelope. Protobuf's own rules apply (unknown
/// fields skipped, the last value of a repeated scalar field kept); a payload that is
/// not a message, or one without a trade, is refused.
pub fn decode(plaintext: &[u8]) -> Result<Opened, RequestError> {
    let mut request = ClearingRequest::decode(plaintext)?;
    let trade = request.trade.take().ok_or(RequestError::NoTrade)?;
    Ok(Opened { request, trade })
}

/// The submission a decoded request makes for `member_id` (from its certificate) and the
/// envelope's `request_id`.
pub fn submission(member_id: &str, request_id: &str, opened: Opened) -> Submission {
    let Opened { request, trade } = opened;
    Submission {
        member_id: member_id.to_owned(),
        request_id: request_id.to_owned(),
        trade: TradeInput {
            buyer: trade.buyer,
            seller: trade.seller,
            instrument: trade.instrument,
            currency: trade.currency,
            amount_minor: trade.amount_minor,
            value_date: trade.value_date,
            jurisdiction: trade.jurisdiction,
            counterparty_tier: trade.counterparty_tier,
        },
        colouring: Colouring {
            trace_id: request.trace_id,
            model_stage: request.model_stage,
            semantic_tag: request.semantic_tag,
            traceparent: request.traceparent,
        },
    }
}

/// Everything the gateway checks of a payload before it looks anything up: decoded, a
/// trade present, every field of the trade valid, the trace id well formed. On success,
/// the trade and its digest (what a replay of the request id must match).
pub fn check(
    member_id: &str,
    request_id: &str,
    plaintext: &[u8],
) -> Result<(aether_gpu_worker::trade::Trade, String), CheckError> {
    let submission = submission(member_id, request_id, decode(plaintext)?);
    Ok(crate::clearing::check(&submission)?)
}

/// A payload refused by [`check`].
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Clear(#[from] ClearError),
}
