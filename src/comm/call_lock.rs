//! The lock that serialises the calls on one NCCL communicator across threads.
//!
//! NCCL's calls on one communicator must not overlap, and a call that returned
//! `ncclInProgress` must be polled to `ncclSuccess` before the next one; `ncclCommAbort` frees
//! the communicator. So a `Comm` shared between threads holds this lock from a call's issue
//! through its settling, around every poll of its state, and around the abort. The thread that
//! holds it may take it again (a barrier issues an all-reduce and then polls; [`group`] holds
//! the locks of all its communicators while the closure issues calls on them), which a
//! `std::sync::Mutex` cannot do.
//!
//! [`group`]: super::group

use std::marker::PhantomData;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::{self, ThreadId};

/// A re-entrant lock: free, or held by one thread some number of times.
#[derive(Default)]
pub(crate) struct CallLock {
    state: Mutex<Holder>,
    freed: Condvar,
}

#[derive(Default)]
struct Holder {
    thread: Option<ThreadId>,
    depth: usize,
}

/// One hold of a [`CallLock`]; released on drop, on the thread that took it (not `Send`).
pub(crate) struct CallGuard<'a> {
    lock: &'a CallLock,
    _not_send: PhantomData<*const ()>,
}

impl CallLock {
    /// Takes the lock, waiting while another thread holds it; at once if this thread does.
    pub(crate) fn lock(&self) -> CallGuard<'_> {
        let me = thread::current().id();
        let mut holder = self.holder();
        while holder.thread.is_some_and(|t| t != me) {
            holder = self.freed.wait(holder).unwrap_or_else(|p| p.into_inner());
        }
        holder.thread = Some(me);
        holder.depth += 1;
        CallGuard {
            lock: self,
            _not_send: PhantomData,
        }
    }

    /// Whether this thread holds the lock.
    #[cfg(test)]
    fn held_here(&self) -> bool {
        self.holder().thread == Some(thread::current().id())
    }

    fn holder(&self) -> MutexGuard<'_, Holder> {
        // The holder's two fields are updated together under the mutex; a panic elsewhere
        // cannot leave them half-written.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        let mut holder = self.lock.holder();
        holder.depth -= 1;
        if holder.depth == 0 {
            holder.thread = None;
            self.lock.freed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn the_holder_takes_it_again_and_others_wait() {
        let lock = CallLock::default();
        let inside = AtomicUsize::new(0);
        let outer = lock.lock();
        let inner = lock.lock();
        assert!(lock.held_here());
        thread::scope(|s| {
            let other = s.spawn(|| {
                let _g = lock.lock();
                // Only once the first thread has let go of both holds.
                inside.load(Ordering::SeqCst)
            });
            thread::sleep(Duration::from_millis(50));
            assert!(!other.is_finished(), "another thread got the held lock");
            drop(inner);
            thread::sleep(Duration::from_millis(20));
            assert!(!other.is_finished(), "released after one of two holds");
            inside.store(7, Ordering::SeqCst);
            drop(outer);
            assert_eq!(other.join().unwrap(), 7);
        });
        assert!(!lock.held_here());
    }
}
