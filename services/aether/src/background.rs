//! The runtime for work that no member's answer waits on: the lineage relays and the
//! Merkle log follower. Its threads run at a lower CPU priority (a higher nice value), so
//! on a busy machine a relay's Parquet encoding or record mapping yields the cores to the
//! decisions being answered, and catches up in the gaps or when the load eases. Lineage
//! is behind the ledger by design (its lag is measured and reported); a decision's SLA is
//! not.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use tokio::runtime::Runtime;

/// The background runtime. Dropped (from async code too) without waiting for its tasks:
/// `serve` awaits the ones that must finish before it lets go.
pub struct Background(Option<Runtime>);

impl Background {
    pub fn handle(&self) -> &tokio::runtime::Handle {
        match &self.0 {
            Some(runtime) => runtime.handle(),
            None => unreachable!("the runtime is only taken on drop"),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// Starts the background runtime: as many threads as the machine has cores, each (and
/// each of its blocking threads) `nice` steps lower in priority than the thread that
/// starts it, like `nice -n` (0 = the same priority as the answers; at most 19).
pub fn start(nice: i32) -> anyhow::Result<Background> {
    // One value for every thread: a blocking thread is started by a worker already
    // lowered, so "lower than my creator" would compound.
    let target = (this_threads_nice() + nice).min(19);
    let warned = std::sync::Arc::new(AtomicBool::new(false));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .thread_name("aether-background")
        .enable_all()
        .on_thread_start(move || {
            if nice == 0 {
                return;
            }
            if let Err(e) = set_this_threads_nice(target) {
                // Once: every thread would fail the same way.
                if !warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        nice = target,
                        error = %e,
                        "cannot lower the background threads' priority; lineage competes with the answers for CPU"
                    );
                }
            }
        })
        .build()
        .context("cannot start the background runtime")?;
    Ok(Background(Some(runtime)))
}

/// Sets the calling thread's nice value (on Linux, where a thread has its own; raising
/// it needs no privilege). Elsewhere an error.
fn set_this_threads_nice(nice: i32) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take no pointers; setpriority on a thread id
        // changes that thread only (Linux, `man 2 setpriority`, NOTES).
        let tid = unsafe { libc::gettid() };
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = nice;
        Err(std::io::Error::other(
            "per-thread priorities are set on Linux only",
        ))
    }
}

/// The nice value of the calling thread (Linux; 0 elsewhere).
fn this_threads_nice() -> i32 {
    #[cfg(target_os = "linux")]
    // SAFETY: no pointers; -1 is a valid answer, and the call cannot fail for this thread.
    unsafe {
        libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t)
    }
    #[cfg(not(target_os = "linux"))]
    0
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn the_background_threads_run_at_the_nice_value_asked_for() {
        let before = this_threads_nice();
        let background = start(3).expect("runtime");
        let runtime = background.handle();
        // The first blocking thread is started by a worker (already lowered): it must not
        // be lowered twice.
        let from_worker = runtime.block_on(
            runtime.spawn(async { tokio::task::spawn_blocking(this_threads_nice).await }),
        );
        let on_worker = runtime.block_on(runtime.spawn(async { this_threads_nice() }));
        let on_blocking = runtime.block_on(runtime.spawn_blocking(this_threads_nice));
        let expected = (before + 3).min(19);
        assert_eq!(on_worker.expect("worker task"), expected);
        assert_eq!(on_blocking.expect("blocking task"), expected);
        assert_eq!(from_worker.expect("worker").expect("blocking"), expected);
        // The caller's own thread keeps its priority.
        assert_eq!(this_threads_nice(), before);
    }
}
