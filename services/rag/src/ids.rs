//! Names and ids: corpus names, document ids, explicit clause anchors, and the slugs of
//! derived clause ids.

use crate::error::RagError;

/// Longest corpus name, document id or explicit anchor, in bytes.
pub const MAX_NAME_BYTES: usize = 64;

/// Longest slug of one heading in a derived clause id, in bytes.
const MAX_SLUG_BYTES: usize = 80;

/// The rule shared by corpus names, document ids and anchors: 1 to 64 bytes of
/// `a-z 0-9 - _ .`, starting with a letter or digit. `None` when `name` follows it.
pub(crate) fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("it is empty".to_string());
    }
    if name.len() > MAX_NAME_BYTES {
        return Some(format!(
            "it is {} bytes, more than {MAX_NAME_BYTES}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .next()
        .filter(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit()))
    {
        return Some(format!(
            "it starts with {c:?}; it must start with a lowercase letter or a digit"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.')))
    {
        return Some(format!(
            "it contains {c:?}; only a-z, 0-9, '-', '_' and '.' are allowed"
        ));
    }
    None
}

/// A corpus name, e.g. `sg-clearing`; it becomes part of the ledger stream `corpus/{name}`.
pub fn validate_corpus_name(name: &str) -> Result<(), RagError> {
    if name.is_empty() {
        return Err(RagError::EmptyCorpusName);
    }
    match name_problem(name) {
        None => Ok(()),
        Some(reason) => Err(RagError::InvalidCorpusName {
            name: name.to_string(),
            reason,
        }),
    }
}

/// A document id, e.g. `threshold-reporting` (a file's name without its extension).
pub fn validate_document_id(id: &str) -> Result<(), RagError> {
    match name_problem(id) {
        None => Ok(()),
        Some(reason) => Err(RagError::InvalidDocumentId {
            id: id.to_string(),
            reason,
        }),
    }
}

/// The slug of a heading in a derived clause id: letters and digits lowercased (any
/// script), every other run of characters one `-`, no `-` at either end, at most 80
/// bytes. `section` when nothing is left.
pub(crate) fn slug(heading: &str) -> String {
    let mut out = String::with_capacity(heading.len());
    let mut dash = false;
    for c in heading.chars() {
        if c.is_alphanumeric() {
            if dash && !out.is_empty() {
                out.push('-');
            }
            dash = false;
            for lower in c.to_lowercase() {
                if out.len() + lower.len_utf8() > MAX_SLUG_BYTES {
                    return finish_slug(out);
                }
                out.push(lower);
            }
        } else {
            dash = true;
        }
    }
    finish_slug(out)
}

fn finish_slug(mut out: String) -> String {
    while out.ends_with('-') {
        out.pop();
    }
    if out.is_empty() {
        "section".to_string()
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs() {
        assert_eq!(slug("Reporting threshold"), "reporting-threshold");
        assert_eq!(
            slug("  1.2  Large-exposure limits (LE) "),
            "1-2-large-exposure-limits-le"
        );
        assert_eq!(slug("§§ —"), "section");
        assert_eq!(slug("Kundensorgfalt Übersicht"), "kundensorgfalt-übersicht");
        assert_eq!(slug("大额交易报告"), "大额交易报告");
        let long = "word ".repeat(40);
        assert!(slug(&long).len() <= MAX_SLUG_BYTES);
        assert!(!slug(&long).ends_with('-'));
    }

    #[test]
    fn names() {
        assert!(name_problem("rep-threshold-1").is_none());
        assert!(name_problem("a.b_c").is_none());
        assert!(name_problem("").is_some());
        assert!(name_problem("-a").is_some());
        assert!(name_problem("Rep").is_some());
        assert!(name_problem("a b").is_some());
        assert!(name_problem(&"a".repeat(65)).is_some());
        assert_eq!(validate_corpus_name(""), Err(RagError::EmptyCorpusName));
    }
}
