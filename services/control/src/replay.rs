//! Feeding a projection from the ledger, page by page, in seq order.

use aether_ledger::{EventFilter, EventStore, LedgerError, RecordedEvent};

/// Events read per page while rebuilding a projection.
const PAGE: u32 = 500;

/// Calls `apply` on every event matching `filter`, in seq order.
pub(crate) async fn for_each_event(
    store: &EventStore,
    filter: &EventFilter,
    mut apply: impl AsyncFnMut(&RecordedEvent),
) -> Result<(), LedgerError> {
    let mut after = 0;
    loop {
        let page = store.query(filter, after, PAGE).await?;
        let Some(last) = page.last() else {
            return Ok(());
        };
        after = last.seq;
        for event in &page {
            apply(event).await;
        }
    }
}
