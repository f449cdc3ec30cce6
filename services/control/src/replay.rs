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

/// Feeds `apply` the events matching `main`, page by page, merged in seq order with the
/// events matching each of `extras` (a projection's few foreign events, such as
/// promotions and rollbacks, read whole), so that it sees them in ledger order.
pub(crate) async fn merged(
    store: &EventStore,
    main: &EventFilter,
    extras: &[EventFilter],
    mut apply: impl FnMut(&RecordedEvent),
) -> Result<(), LedgerError> {
    let mut foreign = Vec::new();
    for filter in extras {
        let mut pages = Pages::new(store, filter);
        while let Some(page) = pages.next().await? {
            foreign.extend(page);
        }
    }
    foreign.sort_by_key(|e| e.seq);
    let mut foreign = foreign.into_iter().peekable();
    let mut pages = Pages::new(store, main);
    while let Some(page) = pages.next().await? {
        for event in &page {
            while let Some(earlier) = foreign.next_if(|f| f.seq < event.seq) {
                apply(&earlier);
            }
            apply(event);
        }
    }
    foreign.for_each(|e| apply(&e));
    Ok(())
}

/// The events matching a filter that came after the last one seen, a page at a time: how a
/// node follows what other nodes record. `after` moves on with every page, so each event is
/// handed out once.
pub(crate) struct After {
    filter: EventFilter,
    after: u64,
}

impl After {
    pub(crate) fn new(filter: EventFilter) -> After {
        After { filter, after: 0 }
    }

    /// Following from after seq `after`.
    pub(crate) fn from(filter: EventFilter, after: u64) -> After {
        After { filter, after }
    }

    /// The next page of new events, `None` when there is none.
    pub(crate) async fn next(
        &mut self,
        store: &EventStore,
    ) -> Result<Option<Vec<RecordedEvent>>, LedgerError> {
        let page = store.query(&self.filter, self.after, PAGE).await?;
        Ok(page.last().map(|last| last.seq).map(|seq| {
            self.after = seq;
            page
        }))
    }
}
