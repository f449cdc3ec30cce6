//! Bad input is refused with a precise error.

use std::io::Write;

use aether_rag::{
    Corpus, CorpusVersion, DocumentSource, MAX_DOCUMENT_BYTES, RagError, validate_corpus_name,
};

use crate::md;

fn build(sources: Vec<DocumentSource>) -> Result<CorpusVersion, RagError> {
    CorpusVersion::build("c", sources)
}

fn error(sources: Vec<DocumentSource>) -> RagError {
    build(sources).expect_err("refused")
}

#[test]
fn corpus_names() {
    assert_eq!(Corpus::new("").map(|_| ()), Err(RagError::EmptyCorpusName));
    assert_eq!(
        CorpusVersion::build("", [md("d", "text")]).map(|_| ()),
        Err(RagError::EmptyCorpusName)
    );
    assert!(validate_corpus_name("sg-clearing").is_ok());
    for bad in ["SG", "sg clearing", "-sg", "sg/clearing", &"s".repeat(65)] {
        match Corpus::new(bad) {
            Err(RagError::InvalidCorpusName { name, .. }) => assert_eq!(name, bad),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert_eq!(
        Corpus::new("sg clearing")
            .map(|_| ())
            .expect_err("bad")
            .to_string(),
        "corpus name \"sg clearing\" is invalid: it contains ' '; only a-z, 0-9, '-', '_' and '.' are allowed"
    );
}

#[test]
fn document_ids() {
    for bad in ["", "Rules", "a/b", "..", &"d".repeat(65)] {
        match error(vec![md(bad, "text")]) {
            RagError::InvalidDocumentId { id, .. } => assert_eq!(id, bad),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

#[test]
fn empty_documents() {
    for text in ["", " ", "\n\n\t\r\n", "\u{feff}", "\u{feff}  \n"] {
        assert_eq!(
            error(vec![md("d", text)]),
            RagError::EmptyDocument {
                document: "d".into()
            },
            "{text:?}"
        );
    }
    assert_eq!(
        error(vec![md("d", "# Title\n## Section\n### Sub\n")]),
        RagError::NoClauses {
            document: "d".into()
        }
    );
    assert_eq!(
        error(vec![md("d", "")]).to_string(),
        "document d is empty: it has no text"
    );
}

#[test]
fn oversize_documents() {
    let over = vec![b'a'; MAX_DOCUMENT_BYTES + 1];
    assert_eq!(
        error(vec![DocumentSource::plain_text("big", over)]),
        RagError::DocumentTooLarge {
            document: "big".into(),
            size: MAX_DOCUMENT_BYTES + 1,
            limit: MAX_DOCUMENT_BYTES
        }
    );
    assert_eq!(MAX_DOCUMENT_BYTES, 1024 * 1024);
    // Exactly the limit passes the size check (and fails later, on its last byte).
    let mut at_limit = vec![b'a'; MAX_DOCUMENT_BYTES];
    at_limit[MAX_DOCUMENT_BYTES - 1] = 0xff;
    assert!(matches!(
        error(vec![DocumentSource::plain_text("big", at_limit)]),
        RagError::InvalidUtf8 { offset, .. } if offset == MAX_DOCUMENT_BYTES - 1
    ));
}

#[test]
fn invalid_utf8_names_byte_and_line() {
    let mut bytes = b"# T\nline two\nbad \xc3\x28 here\n".to_vec();
    assert_eq!(
        error(vec![DocumentSource::markdown("d", bytes.clone())]),
        RagError::InvalidUtf8 {
            document: "d".into(),
            offset: 17,
            line: 3
        }
    );
    bytes.truncate(3);
    bytes.push(0x80);
    assert!(matches!(
        error(vec![DocumentSource::markdown("d", bytes)]),
        RagError::InvalidUtf8 {
            offset: 3,
            line: 1,
            ..
        }
    ));
}

#[test]
fn bad_anchors_name_line_anchor_and_reason() {
    let err = error(vec![md("d", "# T\n\n## Limits {#Large-Exposure}\ntext\n")]);
    assert_eq!(
        err,
        RagError::BadAnchor {
            document: "d".into(),
            line: 3,
            anchor: "{#Large-Exposure}".into(),
            reason: "the id is not valid: it starts with 'L'; it must start with a lowercase letter or a digit".into()
        }
    );
    assert_eq!(
        err.to_string(),
        "document d, line 3: bad anchor \"{#Large-Exposure}\": the id is not valid: it starts with 'L'; it must start with a lowercase letter or a digit"
    );
    for (text, line, anchor) in [
        ("## A {#}\n", 1, "{#}"),
        ("## A {#a b}\n", 1, "{#a b}"),
        ("## A {#open\n", 1, "{#open"),
        ("## A {#a} then text\n", 1, "{#a} then text"),
        ("text\n\n2. {#unclosed and more\n", 3, "{#unclosed and more"),
        ("1. {#a}joined\n", 1, "{#a}"),
        ("1. {#a_b!} x\n", 1, "{#a_b!}"),
    ] {
        match error(vec![md("d", text)]) {
            RagError::BadAnchor {
                line: l, anchor: a, ..
            } => {
                assert_eq!((l, a.as_str()), (line, anchor), "{text:?}");
            }
            other => panic!("{text:?}: {other:?}"),
        }
    }
    // In plain text, anchors on numbered paragraphs are checked too; headings do not exist.
    assert!(matches!(
        error(vec![DocumentSource::plain_text("d", "1. {#Bad} x")]),
        RagError::BadAnchor { .. }
    ));
    assert!(build(vec![DocumentSource::plain_text("d", "# A {#Bad}")]).is_ok());
    // Inside a code block nothing is an anchor.
    assert!(build(vec![md("d", "text\n```\n## A {#Bad}\n```\n")]).is_ok());
}

#[test]
fn a_document_given_twice_in_one_ingest() {
    assert_eq!(
        error(vec![md("d", "one"), md("d", "two")]),
        RagError::DuplicateDocument {
            document: "d".into()
        }
    );
}

#[test]
fn files() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("rules.md"), "1. {#r} Rule.\n").expect("write");
    std::fs::write(dir.path().join("notes.txt"), "1. Note.\n").expect("write");
    std::fs::write(dir.path().join(".hidden"), "ignored").expect("write");
    let sources = DocumentSource::read_dir(dir.path()).expect("reads");
    let ids: Vec<(&str, aether_rag::DocumentFormat)> =
        sources.iter().map(|s| (s.id.as_str(), s.format)).collect();
    assert_eq!(
        ids,
        [
            ("notes", aether_rag::DocumentFormat::PlainText),
            ("rules", aether_rag::DocumentFormat::Markdown)
        ]
    );
    let version = build(sources).expect("builds");
    assert!(version.clause("notes/1").is_some());

    let pdf = dir.path().join("scan.pdf");
    std::fs::write(&pdf, "%PDF").expect("write");
    assert_eq!(
        DocumentSource::read_dir(dir.path()),
        Err(RagError::UnsupportedFile {
            path: pdf.display().to_string()
        })
    );
    std::fs::remove_file(&pdf).expect("remove");

    let big = dir.path().join("big.md");
    let mut file = std::fs::File::create(&big).expect("create");
    file.write_all(&vec![b'x'; MAX_DOCUMENT_BYTES + 10])
        .expect("write");
    drop(file);
    assert_eq!(
        DocumentSource::read(&big),
        Err(RagError::DocumentTooLarge {
            document: "big".into(),
            size: MAX_DOCUMENT_BYTES + 10,
            limit: MAX_DOCUMENT_BYTES
        })
    );
    let missing = dir.path().join("missing.md");
    assert!(matches!(
        DocumentSource::read(&missing),
        Err(RagError::Read { path, .. }) if path == missing.display().to_string()
    ));
    assert!(matches!(
        DocumentSource::read_dir(&dir.path().join("nope")),
        Err(RagError::Read { .. })
    ));
    // A file name that is not a document id is refused on ingest.
    std::fs::remove_file(&big).expect("remove");
    std::fs::write(dir.path().join("Bad Name.md"), "text").expect("write");
    let sources = DocumentSource::read_dir(dir.path()).expect("reads");
    assert!(matches!(
        build(sources),
        Err(RagError::InvalidDocumentId { .. })
    ));
}
