//! Documents as given (`DocumentSource`), as ingested (`Document`), and their clauses.

use std::fs;
use std::io::Read;
use std::path::Path;

use aether_ledger::hashing::sm3;
use serde::{Deserialize, Serialize};

use crate::error::RagError;
use crate::ids::validate_document_id;
pub use crate::parse::DocumentFormat;
use crate::parse::parse;

/// Largest document accepted, in bytes (1 MiB).
pub const MAX_DOCUMENT_BYTES: usize = 1 << 20;

/// A document as given to an ingest: raw bytes, checked only when ingested.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocumentSource {
    /// `a-z 0-9 - _ .`, 1 to 64 bytes, starting with a letter or digit.
    pub id: String,
    pub format: DocumentFormat,
    pub bytes: Vec<u8>,
}

impl DocumentSource {
    pub fn markdown(id: impl Into<String>, bytes: impl Into<Vec<u8>>) -> DocumentSource {
        DocumentSource {
            id: id.into(),
            format: DocumentFormat::Markdown,
            bytes: bytes.into(),
        }
    }

    pub fn plain_text(id: impl Into<String>, bytes: impl Into<Vec<u8>>) -> DocumentSource {
        DocumentSource {
            id: id.into(),
            format: DocumentFormat::PlainText,
            bytes: bytes.into(),
        }
    }

    /// Reads one file. Its id is the file name without the extension; the extension
    /// gives the format (`.md`, `.markdown`, `.txt`). A file over
    /// [`MAX_DOCUMENT_BYTES`] is refused without being read whole.
    pub fn read(path: &Path) -> Result<DocumentSource, RagError> {
        let shown = path.display().to_string();
        let format = path
            .extension()
            .and_then(|e| e.to_str())
            .and_then(DocumentFormat::from_extension)
            .ok_or_else(|| RagError::UnsupportedFile {
                path: shown.clone(),
            })?;
        let id = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let read_error = |e: std::io::Error| RagError::Read {
            path: shown.clone(),
            message: e.to_string(),
        };
        let file = fs::File::open(path).map_err(read_error)?;
        let mut bytes = Vec::new();
        file.take(MAX_DOCUMENT_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(read_error)?;
        if bytes.len() > MAX_DOCUMENT_BYTES {
            let size = fs::metadata(path)
                .ok()
                .and_then(|m| usize::try_from(m.len()).ok())
                .unwrap_or(bytes.len());
            return Err(RagError::DocumentTooLarge {
                document: id,
                size,
                limit: MAX_DOCUMENT_BYTES,
            });
        }
        Ok(DocumentSource { id, format, bytes })
    }

    /// Reads every document in a folder (not its subfolders' contents), in file-name
    /// order. Hidden entries (`.name`) are skipped; any other entry that is not a `.md`,
    /// `.markdown` or `.txt` file is an error, so nothing is left out unnoticed.
    pub fn read_dir(dir: &Path) -> Result<Vec<DocumentSource>, RagError> {
        let read_error = |e: std::io::Error| RagError::Read {
            path: dir.display().to_string(),
            message: e.to_string(),
        };
        let mut paths = Vec::new();
        for entry in fs::read_dir(dir).map_err(read_error)? {
            let entry = entry.map_err(read_error)?;
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            paths.push(entry.path());
        }
        paths.sort();
        paths.iter().map(|p| DocumentSource::read(p)).collect()
    }
}

/// A document in a corpus version. Its text lives on in its clauses; `digest` is the SM3
/// of the bytes as given.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Document {
    pub id: String,
    /// The document's level-1 title heading, else its id.
    pub title: String,
    pub format: DocumentFormat,
    /// SM3 of the bytes as given, lowercase hex.
    pub digest: String,
    /// Length of the bytes as given.
    pub bytes: usize,
    /// Number of clauses.
    pub clauses: usize,
}

/// A clause: a section's own text or a numbered paragraph, with a stable id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Clause {
    /// The author's anchor, or `{document}/{heading slugs…}[/{number}]`.
    pub id: String,
    pub document_id: String,
    /// Headings above the clause, outermost first (the document's title not included).
    pub heading_path: Vec<String>,
    /// The innermost heading, or the document's title for its preamble.
    pub heading: String,
    /// A numbered paragraph's number as written (`3`, `1.2`); `None` for a section.
    pub number: Option<String>,
    /// Whether `id` is an anchor the author wrote.
    pub explicit_id: bool,
    /// The text, Markdown as written, without the number and anchor; may be empty for an
    /// anchored heading with no text of its own.
    pub text: String,
    /// 1-based line where the clause starts (its heading or number).
    pub line: usize,
}

/// A checked and parsed document with its clauses, in the order written.
#[derive(Clone, Debug)]
pub(crate) struct IngestedDocument {
    pub document: Document,
    pub clauses: Vec<Clause>,
}

/// Checks one document and splits it into clauses. Checks, in order: id syntax, empty,
/// size, UTF-8, white space only, anchors, at least one clause. A UTF-8 byte-order mark is
/// ignored.
pub(crate) fn ingest_document(source: &DocumentSource) -> Result<IngestedDocument, RagError> {
    validate_document_id(&source.id)?;
    let document = source.id.clone();
    if source.bytes.is_empty() {
        return Err(RagError::EmptyDocument { document });
    }
    if source.bytes.len() > MAX_DOCUMENT_BYTES {
        return Err(RagError::DocumentTooLarge {
            document,
            size: source.bytes.len(),
            limit: MAX_DOCUMENT_BYTES,
        });
    }
    let text = std::str::from_utf8(&source.bytes).map_err(|e| {
        let offset = e.valid_up_to();
        RagError::InvalidUtf8 {
            document: document.clone(),
            offset,
            line: 1 + source.bytes[..offset]
                .iter()
                .filter(|b| **b == b'\n')
                .count(),
        }
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if text.trim().is_empty() {
        return Err(RagError::EmptyDocument { document });
    }
    let parsed = parse(&source.id, text, source.format)?;
    if parsed.clauses.is_empty() {
        return Err(RagError::NoClauses { document });
    }
    let title = parsed.title.unwrap_or_else(|| source.id.clone());
    let clauses: Vec<Clause> = parsed
        .clauses
        .into_iter()
        .map(|c| Clause {
            heading: c
                .heading_path
                .last()
                .cloned()
                .unwrap_or_else(|| title.clone()),
            id: c.id,
            document_id: source.id.clone(),
            heading_path: c.heading_path,
            number: c.number,
            explicit_id: c.explicit_id,
            text: c.text,
            line: c.line,
        })
        .collect();
    Ok(IngestedDocument {
        document: Document {
            id: source.id.clone(),
            title,
            format: source.format,
            digest: hex::encode(sm3(&source.bytes)),
            bytes: source.bytes.len(),
            clauses: clauses.len(),
        },
        clauses,
    })
}

/// Name of the shipped example corpus.
pub const EXAMPLE_CORPUS_NAME: &str = "aether-example";

const EXAMPLE_DOCUMENTS: [(&str, &[u8]); 3] = [
    (
        "large-exposures",
        include_bytes!("../corpus/large-exposures.md"),
    ),
    (
        "record-keeping",
        include_bytes!("../corpus/record-keeping.md"),
    ),
    (
        "threshold-reporting",
        include_bytes!("../corpus/threshold-reporting.md"),
    ),
];

/// The example corpus shipped in `services/rag/corpus/` (fictional "Aether example
/// rules"), compiled in, so that demos and tests need no files.
pub fn example_documents() -> Vec<DocumentSource> {
    EXAMPLE_DOCUMENTS
        .iter()
        .map(|(id, bytes)| DocumentSource::markdown(*id, bytes.to_vec()))
        .collect()
}
