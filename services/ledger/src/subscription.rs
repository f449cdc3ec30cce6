//! Catch-up subscriptions: read the ledger from a position, then follow it live.
//!
//! Events always come in seq order, as committed: from the writer's tail of what this
//! process committed recently (the very rows it inserted), else from the database. So a
//! subscriber never sees a gap or a reordering, whatever the writer does; the writer's
//! commit signal only wakes it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use crate::error::LedgerError;
use crate::event::RecordedEvent;
use crate::store::EventStore;

/// Rows fetched per database read while catching up.
const PAGE: u32 = 500;
/// How often a live subscriber looks for events written by other processes.
const POLL: Duration = Duration::from_millis(500);

/// A position in the ledger that yields every event from there on, forever.
pub struct Subscription {
    store: EventStore,
    next_seq: u64,
    buffer: VecDeque<Arc<RecordedEvent>>,
    name: Option<String>,
    committed: tokio::sync::watch::Receiver<u64>,
    /// The last read came back short: it reached the end of the ledger.
    at_end: bool,
}

/// Subscriptions are made by the store they read (defined here, beside what they make,
/// so that the store does not depend on its readers).
impl EventStore {
    /// A catch-up subscription from `from_seq` (inclusive) that turns live at the head.
    pub fn subscribe(&self, from_seq: u64) -> Subscription {
        Subscription::new(self.clone(), from_seq.max(1), None)
    }

    /// A named subscription resuming after its stored position; the subscriber stores its
    /// progress with [`Subscription::save_position`].
    pub async fn subscribe_named(&self, name: &str) -> Result<Subscription, LedgerError> {
        let position = self.load_position(name).await?.unwrap_or(0);
        Ok(Subscription::new(
            self.clone(),
            position + 1,
            Some(name.to_owned()),
        ))
    }
}

impl Subscription {
    pub(crate) fn new(store: EventStore, next_seq: u64, name: Option<String>) -> Self {
        let committed = store.committed_seq();
        Subscription {
            store,
            next_seq,
            buffer: VecDeque::new(),
            name,
            committed,
            at_end: false,
        }
    }

    /// The seq the next call to [`Subscription::next`] returns.
    pub fn next_seq(&self) -> u64 {
        self.next_seq - self.buffer.len() as u64
    }

    /// The name whose position is stored, for named subscriptions.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The next event; waits for one to be committed when caught up.
    pub async fn next(&mut self) -> Result<RecordedEvent, LedgerError> {
        self.next_shared().await.map(Arc::unwrap_or_clone)
    }

    /// [`Subscription::next`], shared with the ledger's other followers rather than copied.
    async fn next_shared(&mut self) -> Result<Arc<RecordedEvent>, LedgerError> {
        loop {
            if let Some(event) = self.buffer.pop_front() {
                return Ok(event);
            }
            if self.at_end {
                // Caught up: wait for this process's writer, or poll for other writers.
                // (A short page is the end: reading again at once would find nothing, and
                // did so after every group commit, for every subscriber.)
                let _ = tokio::time::timeout(POLL, self.committed.changed()).await;
            }
            self.read_page().await?;
        }
    }

    /// Reads the page after the buffered events into the buffer.
    async fn read_page(&mut self) -> Result<(), LedgerError> {
        // Marked seen before the read: a commit after this point wakes the next wait.
        self.committed.borrow_and_update();
        let page = self.store.read_following(self.next_seq, PAGE).await?;
        self.at_end = page.len() < PAGE as usize;
        if let Some(last) = page.last() {
            self.next_seq = last.seq + 1;
            self.buffer.extend(page);
        }
        Ok(())
    }

    /// Up to `max` events committed now, reading the ledger once when none are buffered;
    /// never waits. Empty means the subscription is at the head, which (appends being
    /// atomic) is the end of an append: a follower that groups the events of one append
    /// asks this to learn whether a group that ends its batch is whole.
    pub async fn next_batch_now(
        &mut self,
        max: usize,
    ) -> Result<Vec<Arc<RecordedEvent>>, LedgerError> {
        if self.buffer.is_empty() {
            self.read_page().await?;
        }
        let n = max.min(self.buffer.len());
        Ok(self.buffer.drain(..n).collect())
    }

    /// Up to `max` events that are available now, waiting only if there are none. Shared
    /// with the ledger's other followers: events this process committed recently are the
    /// very ones its other subscriptions get.
    pub async fn next_batch(&mut self, max: usize) -> Result<Vec<Arc<RecordedEvent>>, LedgerError> {
        let first = self.next_shared().await?;
        let mut out = vec![first];
        while out.len() < max {
            match self.buffer.pop_front() {
                Some(e) => out.push(e),
                None => break,
            }
        }
        Ok(out)
    }

    /// Stores that this named subscriber has processed everything up to `seq`, so that
    /// [`EventStore::subscribe_named`] resumes after it.
    pub async fn save_position(&self, seq: u64) -> Result<(), LedgerError> {
        match &self.name {
            Some(name) => self.store.save_position(name, seq).await,
            None => Ok(()),
        }
    }
}
