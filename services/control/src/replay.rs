//! Feeding a projection from the ledger, page by page, in seq order.

use aether_ledger::{EventFilter, EventStore, LedgerError, RecordedEvent};

/// Events read per page while rebuilding a projection.
const PAGE: u32 = 500;

/// The events matching a filter, a page at a time, in seq order. A loop over pages, not a
/// callback taking an async closure, so that a replay's future is `Send` and can run in
/// an HTTP handler (time travel).
pub(crate) struct Pages<'a> {
    store: &'a EventStore,
    filter: &'a EventFilter,
    after: u64,
    done: bool,
}

impl<'a> Pages<'a> {
    pub(crate) fn new(store: &'a EventStore, filter: &'a EventFilter) -> Pages<'a> {
        Pages {
            store,
            filter,
            after: 0,
            done: false,
        }
    }

    /// The next page, `None` after the last. A short page is the last one, so a
    /// projection of a few events costs one read.
    pub(crate) async fn next(&mut self) -> Result<Option<Vec<RecordedEvent>>, LedgerError> {
        if self.done {
            return Ok(None);
        }
        let page = self.store.query(self.filter, self.after, PAGE).await?;
        match page.last() {
            Some(last) if page.len() == PAGE as usize => self.after = last.seq,
            _ => self.done = true,
        }
        Ok((!page.is_empty()).then_some(page))
    }
}
