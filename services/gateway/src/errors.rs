//! How an error and its causes are written for people: in one line, each cause once.

use std::error::Error;

/// `e` and its causes, `: `-separated, leaving out a cause whose text is already written:
/// many errors print their source (or their source's source) in their own message as
/// well, and tonic's own text is only "transport error", so neither `to_string()` nor
/// every cause in turn reads well on its own.
pub fn error_chain(e: &(dyn Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a fixed text and an optional cause.
    #[derive(Debug)]
    struct Layer(String, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl Error for Layer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|l| l as &(dyn Error + 'static))
        }
    }

    fn chain(texts: &[&str]) -> Layer {
        texts
            .iter()
            .rev()
            .fold(None, |cause, text| {
                Some(Layer(text.to_string(), cause.map(Box::new)))
            })
            .expect("at least one layer")
    }

    #[test]
    fn each_cause_is_written_once() {
        // A library error that prints its source in its own message as well.
        let e = chain(&[
            "cannot connect to the gateway",
            "cannot read certs/member.pem: no such file",
            "no such file",
        ]);
        assert_eq!(
            error_chain(&e),
            "cannot connect to the gateway: cannot read certs/member.pem: no such file"
        );
        // A cause already written two levels up (a client error naming its transport
        // error's I/O error; the transport error says only "transport error").
        let e = chain(&[
            "cannot reach X: transport error: refused",
            "transport error",
            "refused",
        ]);
        assert_eq!(error_chain(&e), "cannot reach X: transport error: refused");
        // Causes not yet written are kept, as anyhow's `{:#}` keeps them.
        let e = chain(&["step one", "step two", "refused"]);
        assert_eq!(error_chain(&e), "step one: step two: refused");
    }
}
