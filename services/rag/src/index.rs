//! The BM25 full-text index of one corpus version: tantivy, in RAM, built once and never
//! changed.
//!
//! Each clause is one tantivy document with two indexed fields, `heading` (document title
//! and heading path) and `body` (the clause text), both analysed the same way: words
//! (letters and digits), at most 40 bytes, lowercased, common English words dropped,
//! Porter-stemmed (English). A query is analysed the same way and becomes a disjunction
//! of term queries over both fields, so user text is never parsed as query syntax and
//! never fails to parse. Documents are added in clause-id order by one thread into one
//! segment, so the same version always gives the same index and the same ranking.

use std::collections::BTreeSet;
use std::fmt;
use std::ops::Range;

use tantivy::collector::TopDocs;
use tantivy::query::{BooleanQuery, Occur, Query, TermQuery};
use tantivy::schema::{
    Field, IndexRecordOption, STORED, Schema, TextFieldIndexing, TextOptions, Value,
};
use tantivy::snippet::SnippetGenerator;
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter, TextAnalyzer,
};
use tantivy::{Index, IndexReader, IndexWriter, ReloadPolicy, Searcher, TantivyDocument, Term};

use crate::document::Clause;
use crate::error::RagError;

/// Name under which the analyser is registered in each index.
const ANALYZER: &str = "aether_en";

/// Longest word indexed, in bytes; longer ones are dropped.
const MAX_WORD_BYTES: usize = 40;

/// Writer memory budget: tantivy's minimum for one thread (its arena grows on demand).
const WRITER_MEMORY_BYTES: usize = 15_000_000;

/// Longest snippet, in characters.
pub const SNIPPET_CHARS: usize = 160;

/// Common English words that carry no meaning for retrieval. Our own short list.
const STOP_WORDS: &[&str] = &[
    "a", "an", "and", "any", "are", "as", "at", "be", "been", "by", "can", "do", "does", "each",
    "for", "from", "has", "have", "if", "in", "into", "is", "it", "its", "of", "on", "or", "so",
    "such", "than", "that", "the", "their", "then", "there", "these", "they", "this", "those",
    "to", "was", "were", "what", "when", "where", "which", "who", "will", "with",
];

/// A match: the clause's position in the version's clause list, its BM25 score, and a
/// snippet of its text.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct IndexHit {
    pub ordinal: usize,
    pub score: f32,
    pub snippet: String,
    pub highlights: Vec<Range<usize>>,
}

pub(crate) struct ClauseIndex {
    searcher: Searcher,
    // Keeps the searcher's index and reader alive and documents what they are.
    _reader: IndexReader,
    analyzer: TextAnalyzer,
    ordinal: Field,
    heading: Field,
    body: Field,
}

impl fmt::Debug for ClauseIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClauseIndex")
            .field("documents", &self.searcher.num_docs())
            .finish_non_exhaustive()
    }
}

fn analyzer() -> TextAnalyzer {
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(MAX_WORD_BYTES))
        .filter(LowerCaser)
        .filter(StopWordFilter::remove(
            STOP_WORDS.iter().map(|w| w.to_string()),
        ))
        .filter(Stemmer::new(Language::English))
        .build()
}

/// The text of a clause's `heading` field: its document's title and its heading path.
pub(crate) fn heading_text(document_title: &str, clause: &Clause) -> String {
    let mut text = document_title.to_string();
    for heading in &clause.heading_path {
        text.push('\n');
        text.push_str(heading);
    }
    text
}

impl ClauseIndex {
    /// Indexes `clauses` (the version's list, in order) with their heading texts; clauses
    /// with empty text are left out.
    pub(crate) fn build<'a>(
        clauses: impl IntoIterator<Item = (&'a Clause, String)>,
    ) -> Result<ClauseIndex, RagError> {
        let text = TextOptions::default().set_indexing_options(
            TextFieldIndexing::default()
                .set_tokenizer(ANALYZER)
                .set_index_option(IndexRecordOption::WithFreqs),
        );
        let mut schema = Schema::builder();
        let ordinal = schema.add_u64_field("ordinal", STORED);
        let heading = schema.add_text_field("heading", text.clone());
        let body = schema.add_text_field("body", text);
        let index = Index::create_in_ram(schema.build());
        index.tokenizers().register(ANALYZER, analyzer());

        let mut writer: IndexWriter = index.writer_with_num_threads(1, WRITER_MEMORY_BYTES)?;
        for (position, (clause, heading_text)) in clauses.into_iter().enumerate() {
            // A clause with no text (an anchored heading alone) can be cited, not found.
            if clause.text.is_empty() {
                continue;
            }
            let mut doc = TantivyDocument::new();
            doc.add_u64(ordinal, position as u64);
            doc.add_text(heading, heading_text);
            doc.add_text(body, &clause.text);
            writer.add_document(doc)?;
        }
        writer.commit()?;
        writer.wait_merging_threads()?;

        let reader: IndexReader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()?;
        Ok(ClauseIndex {
            searcher: reader.searcher(),
            _reader: reader,
            analyzer: analyzer(),
            ordinal,
            heading,
            body,
        })
    }

    /// The query's distinct terms after analysis, in order.
    fn terms(&self, query: &str) -> BTreeSet<String> {
        let mut analyzer = self.analyzer.clone();
        let mut stream = analyzer.token_stream(query);
        let mut terms = BTreeSet::new();
        while stream.advance() {
            terms.insert(stream.token().text.clone());
        }
        terms
    }

    /// The best `limit` clauses for `query` by BM25 (summed over terms and both fields),
    /// best first; `text_of` gives each ordinal's clause text for snippets. Ties are left in
    /// index order (clause-id order); the caller sorts them.
    pub(crate) fn search<'t>(
        &self,
        query: &str,
        limit: usize,
        text_of: impl Fn(usize) -> Option<&'t str>,
    ) -> Result<Vec<IndexHit>, RagError> {
        let terms = self.terms(query);
        if terms.is_empty() || limit == 0 || self.searcher.num_docs() == 0 {
            return Ok(Vec::new());
        }
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = Vec::with_capacity(terms.len() * 2);
        for term in &terms {
            for field in [self.heading, self.body] {
                clauses.push((
                    Occur::Should,
                    Box::new(TermQuery::new(
                        Term::from_field_text(field, term),
                        IndexRecordOption::WithFreqs,
                    )),
                ));
            }
        }
        let query = BooleanQuery::new(clauses);
        let top = self.searcher.search(&query, &TopDocs::with_limit(limit))?;

        let mut snippets = SnippetGenerator::create(&self.searcher, &query, self.body)?;
        snippets.set_max_num_chars(SNIPPET_CHARS);
        let mut hits = Vec::with_capacity(top.len());
        for (score, address) in top {
            let doc: TantivyDocument = self.searcher.doc(address)?;
            let ordinal = doc
                .get_first(self.ordinal)
                .and_then(|v| v.as_u64())
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| RagError::Index {
                    message: format!("indexed document {address:?} has no clause ordinal"),
                })?;
            let text = text_of(ordinal).ok_or_else(|| RagError::Index {
                message: format!("indexed clause ordinal {ordinal} is not in the version"),
            })?;
            let snippet = snippets.snippet(text);
            let (snippet, highlights) = if snippet.fragment().is_empty() {
                (opening(text), Vec::new())
            } else {
                one_line_with(snippet.fragment(), snippet.highlighted())
            };
            hits.push(IndexHit {
                ordinal,
                score,
                snippet,
                highlights,
            });
        }
        Ok(hits)
    }
}

/// `text` with every run of white space as one space, and `highlights` (byte ranges in
/// `text`) moved to match.
fn one_line_with(text: &str, highlights: &[Range<usize>]) -> (String, Vec<Range<usize>>) {
    // moved[i]: where byte i of `text` lands (for every i up to and including text.len()).
    let mut moved = vec![0; text.len() + 1];
    let mut out = String::with_capacity(text.len());
    let mut in_space = false;
    for (at, c) in text.char_indices() {
        for slot in &mut moved[at..at + c.len_utf8()] {
            *slot = out.len();
        }
        if c.is_whitespace() {
            if !in_space {
                out.push(' ');
            }
            in_space = true;
        } else {
            out.push(c);
            in_space = false;
        }
    }
    moved[text.len()] = out.len();
    let highlights = highlights
        .iter()
        .filter(|r| r.start < r.end && r.end <= text.len())
        .map(|r| moved[r.start]..moved[r.end])
        .collect();
    (out, highlights)
}

fn one_line(text: &str) -> String {
    one_line_with(text, &[]).0
}

/// The first [`SNIPPET_CHARS`] characters of `text`, cut at a word boundary when it is
/// longer, on one line.
fn opening(text: &str) -> String {
    let Some((cut, _)) = text.char_indices().nth(SNIPPET_CHARS) else {
        return one_line(text);
    };
    let head = &text[..cut];
    let head = match head.rfind(char::is_whitespace) {
        Some(space) if space > 0 => &head[..space],
        _ => head,
    };
    format!("{}…", one_line(head.trim_end()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn analysis_stems_lowercases_and_drops_stop_words() {
        let mut a = analyzer();
        let mut stream = a.token_stream("Retaining the RECORDS of large exposures");
        let mut words = Vec::new();
        while stream.advance() {
            words.push(stream.token().text.clone());
        }
        assert_eq!(words, ["retain", "record", "larg", "exposur"]);
    }

    #[test]
    fn one_line_moves_highlights() {
        let text = "an  exposure\n   limit";
        let (line, highlights) = one_line_with(text, &[4..12, 16..21]);
        assert_eq!(line, "an exposure limit");
        assert_eq!(highlights, [3..11, 12..17]);
        assert_eq!(&line[3..11], "exposure");
        assert_eq!(&line[12..17], "limit");
    }

    #[test]
    fn openings() {
        assert_eq!(opening("short\ntext"), "short text");
        let long = "word ".repeat(100);
        let o = opening(&long);
        assert!(o.ends_with("word…"), "{o}");
        assert!(o.chars().count() <= SNIPPET_CHARS + 1);
    }
}
