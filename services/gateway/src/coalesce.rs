//! Coalesced writes for the server's TLS connections.
//!
//! Why: h2 flushes a connection each time its task runs, and under load one group commit
//! answers tens of requests of the same connection, one task after another. Tokio runs a
//! task woken by the running one next (its LIFO slot), so the connection task ran after
//! every answer and each answer became its own TLS record and its own `writev`: more than
//! one system call per request, a tenth of the gateway's CPU. [`Coalesced`] puts a flush
//! off once: the first `poll_flush` after new data wakes its own task, which tokio then
//! runs after the tasks already queued, and returns `Pending`; the answers those tasks
//! produce join the same write. No timer is involved: the delay is one pass of the run
//! queue, and a flush asked for again goes out at once.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Buffered bytes beyond which a write goes out without waiting for a flush.
const HIGH_WATER: usize = 64 * 1024;

/// An I/O stream whose writes are buffered until a flush, and whose flushes are put off by
/// one turn of the scheduler (see the module documentation). Reads pass through.
#[derive(Debug)]
pub struct Coalesced<IO> {
    inner: IO,
    buf: Vec<u8>,
    /// How much of `buf` the inner stream has taken.
    written: usize,
    /// Whether this flush has already been put off once.
    deferred: bool,
}

impl<IO> Coalesced<IO> {
    pub fn new(inner: IO) -> Self {
        Coalesced {
            inner,
            buf: Vec::new(),
            written: 0,
            deferred: false,
        }
    }

    /// The wrapped stream (for its connection details).
    pub fn get_ref(&self) -> &IO {
        &self.inner
    }

    fn buffered(&self) -> usize {
        self.buf.len() - self.written
    }
}

impl<IO: AsyncWrite + Unpin> Coalesced<IO> {
    /// Hands every buffered byte to the inner stream.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.buf.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.buf[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.buf.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Coalesced<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Coalesced<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.buffered() >= HIGH_WATER {
            ready!(self.poll_drain(cx))?;
        }
        self.buf.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        slices: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.buffered() >= HIGH_WATER {
            ready!(self.poll_drain(cx))?;
        }
        let mut taken = 0;
        for slice in slices {
            self.buf.extend_from_slice(slice);
            taken += slice.len();
        }
        Poll::Ready(Ok(taken))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.buffered() > 0 && !self.deferred {
            // Rescheduled behind the tasks already queued; see the module documentation.
            self.deferred = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        ready!(self.poll_drain(cx))?;
        self.deferred = false;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected
    for Coalesced<IO>
{
    type ConnectInfo = IO::ConnectInfo;

    /// The wrapped stream's: for TLS, the peer's certificates, which identities come from.
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;

    /// A real in-memory pipe that counts the writes reaching it.
    struct Counting {
        inner: DuplexStream,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncWrite for Counting {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            data: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.writes.fetch_add(1, Ordering::SeqCst);
            Pin::new(&mut self.inner).poll_write(cx, data)
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }
        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    fn pipe(capacity: usize) -> (Coalesced<Counting>, DuplexStream, Arc<AtomicUsize>) {
        let (near, far) = tokio::io::duplex(capacity);
        let writes = Arc::new(AtomicUsize::new(0));
        let counting = Counting {
            inner: near,
            writes: writes.clone(),
        };
        (Coalesced::new(counting), far, writes)
    }

    #[tokio::test]
    async fn answers_written_before_a_flush_go_out_in_one_write_in_order() {
        let (mut conn, mut far, writes) = pipe(1 << 20);
        for answer in ["first ", "second ", "third"] {
            conn.write_all(answer.as_bytes()).await.unwrap();
        }
        assert_eq!(
            writes.load(Ordering::SeqCst),
            0,
            "nothing goes out before a flush"
        );
        conn.flush().await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 1);
        let mut got = vec![0; "first second third".len()];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(got, b"first second third");
    }

    #[tokio::test]
    async fn a_flush_is_put_off_once_and_writes_made_meanwhile_join_it() {
        let (mut conn, mut far, writes) = pipe(1 << 20);
        conn.write_all(b"a").await.unwrap();
        let first =
            std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut conn).poll_flush(cx))).await;
        assert!(first.is_pending(), "the first flush waits one turn");
        conn.write_all(b"b").await.unwrap();
        conn.flush().await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 1);
        let mut got = [0; 2];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ab");
    }

    #[tokio::test]
    async fn a_large_answer_goes_out_whole_through_a_small_pipe() {
        let (mut conn, mut far, _) = pipe(4096);
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let expected = data.clone();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            far.read_to_end(&mut got).await.unwrap();
            got
        });
        conn.write_all(&data).await.unwrap();
        conn.shutdown().await.unwrap();
        drop(conn);
        assert_eq!(reader.await.unwrap(), expected);
    }
}
