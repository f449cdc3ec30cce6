//! Splitting a document's text into clauses. Pure; the rules are written down in the
//! crate's README ("Clauses").
//!
//! - A Markdown heading (`#` to `######`, ATX style, at most 3 spaces of indent) starts a
//!   section. The first heading of a document, when it is level 1, is the document's
//!   title instead: the text around it is the document's preamble.
//! - A line at column 0 that starts with a paragraph number (`1.`, `1)`, `(1)`, `1.2`,
//!   `1.2.`) starts a numbered paragraph; it runs until the next numbered paragraph, the
//!   next heading, or an unindented line after a blank line.
//! - A section's own text (lines that are not in its numbered paragraphs) is a clause when
//!   it is not blank or when its heading carries an anchor; each numbered paragraph is a
//!   clause.
//! - Ids: an anchor written by the author (`## Heading {#id}`, `1. {#id} Text`) wins;
//!   otherwise a section's id is `{document}/{slug}/{slug}…` from the heading path (the
//!   preamble's is the document id itself), and a numbered paragraph's is
//!   `{section anchor or derived id}/{number}`.
//! - Inside fenced code blocks (```` ``` ```` or `~~~`) nothing is a heading or a number.
//! - Plain text has no headings and no fences; numbered paragraphs still count.

use serde::{Deserialize, Serialize};

use crate::error::RagError;
use crate::ids::{name_problem, slug};

/// How a document's text is split into clauses (see the crate's README).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DocumentFormat {
    /// Headings (`#` …) delimit sections; numbered paragraphs are clauses.
    Markdown,
    /// No headings; numbered paragraphs are clauses, the rest is one clause.
    PlainText,
}

impl DocumentFormat {
    /// The format for a file name's extension: `md` / `markdown`, or `txt`.
    pub fn from_extension(extension: &str) -> Option<DocumentFormat> {
        match extension {
            "md" | "markdown" => Some(DocumentFormat::Markdown),
            "txt" => Some(DocumentFormat::PlainText),
            _ => None,
        }
    }
}

/// A clause as found in one document, before it is placed in a corpus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ParsedClause {
    pub id: String,
    pub explicit_id: bool,
    pub heading_path: Vec<String>,
    pub number: Option<String>,
    pub text: String,
    pub line: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ParsedDocument {
    /// The text of a level-1 heading that is the document's first heading.
    pub title: Option<String>,
    /// In the order they appear.
    pub clauses: Vec<ParsedClause>,
}

struct Section<'a> {
    path: Vec<String>,
    anchor: Option<String>,
    /// The heading's line; `None` for the preamble.
    heading_line: Option<usize>,
    /// The title's line, for a preamble whose only content is an anchored title.
    title_line: Option<usize>,
    lines: Vec<(usize, &'a str)>,
}

struct Numbered<'a> {
    number: String,
    anchor: Option<String>,
    line: usize,
    lines: Vec<&'a str>,
    after_blank: bool,
}

#[derive(Clone, Copy)]
struct Fence {
    marker: u8,
    length: usize,
}

struct Heading<'a> {
    level: usize,
    text: &'a str,
    anchor: Option<String>,
}

/// An anchor that breaks the syntax, with why.
struct AnchorProblem {
    anchor: String,
    reason: String,
}

struct Parser<'a> {
    document_id: &'a str,
    clauses: Vec<ParsedClause>,
    section: Section<'a>,
    numbered: Option<Numbered<'a>>,
}

pub(crate) fn parse(
    document_id: &str,
    text: &str,
    format: DocumentFormat,
) -> Result<ParsedDocument, RagError> {
    let markdown = format == DocumentFormat::Markdown;
    let mut parser = Parser {
        document_id,
        clauses: Vec::new(),
        section: Section {
            path: Vec::new(),
            anchor: None,
            heading_line: None,
            title_line: None,
            lines: Vec::new(),
        },
        numbered: None,
    };
    let mut title: Option<String> = None;
    let mut seen_heading = false;
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut fence: Option<Fence> = None;

    for (index, line) in text.lines().enumerate() {
        let line_no = index + 1;
        let bad_anchor = |p: AnchorProblem| RagError::BadAnchor {
            document: document_id.to_string(),
            line: line_no,
            anchor: p.anchor,
            reason: p.reason,
        };
        if markdown {
            if let Some(open) = fence {
                if closes_fence(line, open) {
                    fence = None;
                }
                parser.content(line_no, line, true);
                continue;
            }
            if let Some(open) = opens_fence(line) {
                fence = Some(open);
                parser.content(line_no, line, false);
                continue;
            }
            if let Some(heading) = heading(line) {
                let heading = heading.map_err(bad_anchor)?;
                parser.close_numbered();
                if !seen_heading && heading.level == 1 {
                    title = Some(heading.text.to_string());
                    parser.section.anchor = heading.anchor;
                    parser.section.title_line = Some(line_no);
                } else {
                    parser.close_section();
                    while stack
                        .last()
                        .is_some_and(|(level, _)| *level >= heading.level)
                    {
                        stack.pop();
                    }
                    stack.push((heading.level, heading.text.to_string()));
                    parser.section = Section {
                        path: stack.iter().map(|(_, text)| text.clone()).collect(),
                        anchor: heading.anchor,
                        heading_line: Some(line_no),
                        title_line: None,
                        lines: Vec::new(),
                    };
                }
                seen_heading = true;
                continue;
            }
        }
        if let Some((number, rest)) = paragraph_number(line) {
            let (anchor, rest) = paragraph_anchor(rest).map_err(bad_anchor)?;
            parser.close_numbered();
            parser.numbered = Some(Numbered {
                number,
                anchor,
                line: line_no,
                lines: vec![rest],
                after_blank: false,
            });
            continue;
        }
        parser.content(line_no, line, false);
    }
    parser.close_numbered();
    parser.close_section();
    Ok(ParsedDocument {
        title: title.filter(|t| !t.is_empty()),
        clauses: parser.clauses,
    })
}

impl<'a> Parser<'a> {
    /// A line that is neither a heading nor the start of a numbered paragraph.
    fn content(&mut self, line_no: usize, line: &'a str, in_fence: bool) {
        if let Some(numbered) = self.numbered.as_mut() {
            if in_fence {
                numbered.lines.push(line);
                return;
            }
            if line.trim().is_empty() {
                numbered.lines.push(line);
                numbered.after_blank = true;
                return;
            }
            // An unindented line after a blank line ends the paragraph.
            if !numbered.after_blank || line.starts_with([' ', '\t']) {
                numbered.lines.push(line);
                numbered.after_blank = false;
                return;
            }
            self.close_numbered();
        }
        self.section.lines.push((line_no, line));
    }

    /// The section's id as the base of its numbered paragraphs' ids: its anchor, else
    /// the document id and the slugs of its heading path.
    fn numbered_base(&self) -> String {
        match &self.section.anchor {
            Some(anchor) => anchor.clone(),
            None => self.derived_section_id(),
        }
    }

    fn derived_section_id(&self) -> String {
        let mut id = self.document_id.to_string();
        for heading in &self.section.path {
            id.push('/');
            id.push_str(&slug(heading));
        }
        id
    }

    fn close_numbered(&mut self) {
        let Some(numbered) = self.numbered.take() else {
            return;
        };
        let (id, explicit_id) = match numbered.anchor {
            Some(anchor) => (anchor, true),
            None => (
                format!("{}/{}", self.numbered_base(), numbered.number),
                false,
            ),
        };
        self.clauses.push(ParsedClause {
            id,
            explicit_id,
            heading_path: self.section.path.clone(),
            number: Some(numbered.number),
            text: block_text(dedent_continuation(&numbered.lines).iter().copied()),
            line: numbered.line,
        });
    }

    fn close_section(&mut self) {
        let text = block_text(self.section.lines.iter().map(|(_, l)| *l));
        if text.is_empty() && self.section.anchor.is_none() {
            return;
        }
        let first_text_line = self
            .section
            .lines
            .iter()
            .find(|(_, l)| !l.trim().is_empty())
            .map(|(n, _)| *n);
        let line = self
            .section
            .heading_line
            .or(first_text_line)
            .or(self.section.title_line)
            .unwrap_or(1);
        let (id, explicit_id) = match self.section.anchor.take() {
            Some(anchor) => (anchor, true),
            None => (self.derived_section_id(), false),
        };
        self.clauses.push(ParsedClause {
            id,
            explicit_id,
            heading_path: self.section.path.clone(),
            number: None,
            text,
            line,
        });
    }
}

/// The lines joined with `\n`, blank lines and white space at either end removed.
fn block_text<'a>(lines: impl Iterator<Item = &'a str>) -> String {
    lines.collect::<Vec<_>>().join("\n").trim().to_string()
}

/// A numbered paragraph's lines with the indent that all its continuation lines share
/// removed (the Markdown list indent), keeping any deeper indent.
fn dedent_continuation<'a>(lines: &[&'a str]) -> Vec<&'a str> {
    let indent = |l: &str| l.len() - l.trim_start_matches([' ', '\t']).len();
    let common = lines
        .iter()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|l| indent(l))
        .min()
        .unwrap_or(0);
    lines
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if i == 0 {
                *l
            } else {
                // Blank lines may be shorter than the indent; the indent is ASCII.
                &l[common.min(indent(l))..]
            }
        })
        .collect()
}

/// Up to three spaces of indent, then the rest.
fn strip_indent(line: &str) -> Option<&str> {
    let rest = line.trim_start_matches(' ');
    (line.len() - rest.len() <= 3).then_some(rest)
}

fn opens_fence(line: &str) -> Option<Fence> {
    let rest = strip_indent(line)?;
    let marker = *rest.as_bytes().first()?;
    if marker != b'`' && marker != b'~' {
        return None;
    }
    let length = rest.bytes().take_while(|b| *b == marker).count();
    // A backtick fence's info string may not contain a backtick.
    if length < 3 || (marker == b'`' && rest[length..].contains('`')) {
        return None;
    }
    Some(Fence { marker, length })
}

fn closes_fence(line: &str, open: Fence) -> bool {
    let Some(rest) = strip_indent(line) else {
        return false;
    };
    let length = rest.bytes().take_while(|b| *b == open.marker).count();
    length >= open.length && rest[length..].trim().is_empty()
}

/// `None` when `line` is not an ATX heading; an error when it is one with a bad anchor.
fn heading(line: &str) -> Option<Result<Heading<'_>, AnchorProblem>> {
    let rest = strip_indent(line)?;
    let level = rest.bytes().take_while(|b| *b == b'#').count();
    if level == 0 || level > 6 {
        return None;
    }
    let after = &rest[level..];
    if !(after.is_empty() || after.starts_with([' ', '\t'])) {
        return None;
    }
    let mut content = after.trim();
    // An optional closing sequence of `#`s, after white space.
    let unclosed = content.trim_end_matches('#');
    if unclosed.len() != content.len() && (unclosed.is_empty() || unclosed.ends_with([' ', '\t'])) {
        content = unclosed.trim_end();
    }
    let Some(at) = content.rfind("{#") else {
        return Some(Ok(Heading {
            level,
            text: content,
            anchor: None,
        }));
    };
    let candidate = &content[at..];
    if !candidate.ends_with('}') {
        return Some(Err(AnchorProblem {
            anchor: shorten(candidate),
            reason: "a heading's anchor must be written {#id} at the end of the heading"
                .to_string(),
        }));
    }
    let id = &candidate[2..candidate.len() - 1];
    if let Some(reason) = name_problem(id) {
        return Some(Err(AnchorProblem {
            anchor: shorten(candidate),
            reason: format!("the id is not valid: {reason}"),
        }));
    }
    Some(Ok(Heading {
        level,
        text: content[..at].trim_end(),
        anchor: Some(id.to_string()),
    }))
}

/// A paragraph number at column 0: `1.`, `1)`, `(1)`, `1.2`, `1.2.` followed by white
/// space or the end of the line. Returns the number (`1`, `1.2`) and the rest of the line.
fn paragraph_number(line: &str) -> Option<(String, &str)> {
    let bytes = line.as_bytes();
    let digits_at = |from: usize| {
        bytes[from..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count()
    };
    let (number, end) = if bytes.first() == Some(&b'(') {
        let n = digits_at(1);
        if n == 0 || n > 9 || bytes.get(1 + n) != Some(&b')') {
            return None;
        }
        (&line[1..1 + n], 2 + n)
    } else {
        let first = digits_at(0);
        if first == 0 || first > 9 {
            return None;
        }
        let mut end = first;
        let mut groups = 0;
        while bytes.get(end) == Some(&b'.') {
            let n = digits_at(end + 1);
            if n == 0 || n > 9 {
                break;
            }
            end += 1 + n;
            groups += 1;
        }
        let number_end = end;
        if matches!(bytes.get(end), Some(b'.') | Some(b')')) {
            end += 1;
        } else if groups == 0 {
            return None;
        }
        (&line[..number_end], end)
    };
    let rest = &line[end..];
    if !(rest.is_empty() || rest.starts_with([' ', '\t'])) {
        return None;
    }
    Some((number.to_string(), rest.trim_start()))
}

/// An anchor at the start of a numbered paragraph's text, `{#id} `, and the text after it.
fn paragraph_anchor(rest: &str) -> Result<(Option<String>, &str), AnchorProblem> {
    let Some(after_open) = rest.strip_prefix("{#") else {
        return Ok((None, rest));
    };
    let Some(close) = after_open.find('}') else {
        return Err(AnchorProblem {
            anchor: shorten(rest),
            reason: "the anchor is not closed with '}'".to_string(),
        });
    };
    let id = &after_open[..close];
    let written = &rest[..close + 3];
    if let Some(reason) = name_problem(id) {
        return Err(AnchorProblem {
            anchor: shorten(written),
            reason: format!("the id is not valid: {reason}"),
        });
    }
    let after = &after_open[close + 1..];
    if !(after.is_empty() || after.starts_with([' ', '\t'])) {
        return Err(AnchorProblem {
            anchor: shorten(written),
            reason: "an anchor must be followed by white space or the end of the line".to_string(),
        });
    }
    Ok((Some(id.to_string()), after.trim_start()))
}

/// At most 80 characters of `s`, for error messages.
fn shorten(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(text: &str) -> ParsedDocument {
        parse("doc", text, DocumentFormat::Markdown).expect("parses")
    }

    fn ids(doc: &ParsedDocument) -> Vec<&str> {
        doc.clauses.iter().map(|c| c.id.as_str()).collect()
    }

    #[test]
    fn numbers() {
        assert_eq!(paragraph_number("1. a"), Some(("1".into(), "a")));
        assert_eq!(paragraph_number("12) a"), Some(("12".into(), "a")));
        assert_eq!(paragraph_number("(3) a"), Some(("3".into(), "a")));
        assert_eq!(paragraph_number("1.2 a"), Some(("1.2".into(), "a")));
        assert_eq!(paragraph_number("1.2.3. a"), Some(("1.2.3".into(), "a")));
        assert_eq!(paragraph_number("4."), Some(("4".into(), "")));
        assert_eq!(paragraph_number("2024 was"), None);
        assert_eq!(paragraph_number("1.5million"), None);
        assert_eq!(paragraph_number(" 1. indented"), None);
        assert_eq!(paragraph_number("(a) letter"), None);
        assert_eq!(paragraph_number("1234567890. too long"), None);
    }

    #[test]
    fn headings_sections_and_numbered_paragraphs() {
        let doc = md("# Title {#intro}\n\
             Preamble text.\n\
             \n\
             ## Part one\n\
             Intro of part one.\n\
             \n\
             1. First\n   continued.\n\
             2. {#named} Second.\n\
             \n\
             Trailing text of part one.\n\
             ### Sub ###\n\
             (1) Deep.\n\
             ## Part two {#two}\n\
             ## Empty\n\
             ## Part three\n\
             ```\n## not a heading\n1. not a number\n```\n");
        assert_eq!(doc.title.as_deref(), Some("Title"));
        assert_eq!(
            ids(&doc),
            [
                "intro",
                "doc/part-one/1",
                "named",
                "doc/part-one",
                "doc/part-one/sub/1",
                "two",
                "doc/part-three"
            ]
        );
        let clause = |id: &str| {
            doc.clauses
                .iter()
                .find(|c| c.id == id)
                .unwrap_or_else(|| panic!("no clause {id}"))
        };
        assert_eq!(clause("intro").text, "Preamble text.");
        assert_eq!(clause("intro").line, 2);
        assert!(clause("intro").explicit_id);
        let first = clause("doc/part-one/1");
        assert_eq!(first.text, "First\ncontinued.");
        assert_eq!(first.line, 7);
        assert_eq!(first.number.as_deref(), Some("1"));
        assert_eq!(first.heading_path, ["Part one"]);
        assert!(!first.explicit_id);
        assert_eq!(clause("named").text, "Second.");
        assert_eq!(
            clause("doc/part-one").text,
            "Intro of part one.\n\nTrailing text of part one."
        );
        assert_eq!(clause("doc/part-one").line, 4);
        assert_eq!(
            clause("doc/part-one/sub/1").heading_path,
            ["Part one", "Sub"]
        );
        assert_eq!(clause("two").text, "");
        assert!(clause("doc/part-three").text.contains("## not a heading"));
    }

    #[test]
    fn first_heading_of_level_two_is_not_a_title() {
        let doc = md("## A\ntext\n# B\ntext");
        assert_eq!(doc.title, None);
        assert_eq!(ids(&doc), ["doc/a", "doc/b"]);
    }

    #[test]
    fn plain_text_has_no_headings() {
        let doc = parse(
            "p",
            "# not a heading\n1. one\n2. two",
            DocumentFormat::PlainText,
        )
        .expect("parses");
        assert_eq!(ids(&doc), ["p/1", "p/2", "p"]);
    }

    #[test]
    fn bad_anchors() {
        for (text, line) in [
            ("# T\n## A {#Bad}", 2),
            ("## A {#}", 1),
            ("## A {#a b}", 1),
            ("## A {#open", 1),
            ("## A {#a} trailing", 1),
            ("x\n\n1. {#unclosed text", 3),
            ("1. {#a}text", 1),
            ("1. {#-a} text", 1),
        ] {
            match parse("d", text, DocumentFormat::Markdown) {
                Err(RagError::BadAnchor { line: l, .. }) => assert_eq!(l, line, "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }
}
