//! The associated data: what a sealed payload is bound to.

use super::{DOMAIN_TAG, EnvelopeError, MAX_AAD_FIELD_LEN};

/// Which way a payload travels; a request can never be reflected back as a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    Request,
    Response,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Request => "request",
            Direction::Response => "response",
        }
    }
}

/// The fields bound into the SM4-GCM tag. The server fills them from what it knows (the
/// method it serves, the member id of the client certificate, the key id and request id of
/// the call), never from the sealed payload, so a payload moved to another call fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Aad<'a> {
    pub direction: Direction,
    /// gRPC method full name, e.g. `/aether.v1.ClearingService/Submit`.
    pub method: &'a str,
    pub request_id: &'a str,
    pub member_id: &'a str,
    /// Session key id; empty for a per-request key.
    pub key_id: &'a str,
    /// When the sender sealed it, unix seconds; bounds how long a replay cache must remember.
    pub issued_at: u64,
}

impl<'a> Aad<'a> {
    /// The AAD for the response to this request: same call, other direction, the server's
    /// own issue time.
    pub fn response(&self, issued_at: u64) -> Aad<'a> {
        Aad {
            direction: Direction::Response,
            issued_at,
            ..*self
        }
    }

    /// The exact AAD bytes: seven fields, each a u32 big-endian length then the bytes:
    /// domain tag, direction, method, request id, member id, key id, issued_at (8 bytes BE).
    pub fn encode(&self) -> Result<Vec<u8>, EnvelopeError> {
        let texts: [(&'static str, &str); 4] = [
            ("method", self.method),
            ("request_id", self.request_id),
            ("member_id", self.member_id),
            ("key_id", self.key_id),
        ];
        let mut len = 7 * 4 + DOMAIN_TAG.len() + self.direction.as_str().len() + 8;
        for (field, value) in texts {
            if value.len() > MAX_AAD_FIELD_LEN {
                return Err(EnvelopeError::AadFieldTooLong {
                    field,
                    len: value.len(),
                    max: MAX_AAD_FIELD_LEN,
                });
            }
            len += value.len();
        }
        let mut out = Vec::with_capacity(len);
        push_field(&mut out, DOMAIN_TAG.as_bytes());
        push_field(&mut out, self.direction.as_str().as_bytes());
        for (_, value) in texts {
            push_field(&mut out, value.as_bytes());
        }
        push_field(&mut out, &self.issued_at.to_be_bytes());
        Ok(out)
    }
}

/// Every field is at most `MAX_AAD_FIELD_LEN` bytes (checked above), so it fits a u32.
fn push_field(out: &mut Vec<u8>, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_cannot_slide_into_each_other() {
        let a = Aad {
            direction: Direction::Request,
            method: "m",
            request_id: "ab",
            member_id: "c",
            key_id: "",
            issued_at: 1,
        };
        let b = Aad {
            request_id: "a",
            member_id: "bc",
            ..a
        };
        assert_ne!(a.encode().unwrap(), b.encode().unwrap());
    }

    #[test]
    fn overlong_field_is_refused() {
        let long = "x".repeat(MAX_AAD_FIELD_LEN + 1);
        let a = Aad {
            direction: Direction::Request,
            method: "m",
            request_id: &long,
            member_id: "c",
            key_id: "",
            issued_at: 1,
        };
        assert!(matches!(
            a.encode(),
            Err(EnvelopeError::AadFieldTooLong {
                field: "request_id",
                ..
            })
        ));
    }
}
