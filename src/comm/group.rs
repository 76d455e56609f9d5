//! NCCL groups: several calls issued as one (`ncclGroupStart` .. `ncclGroupEnd`).
//!
//! NCCL's group state is per thread, and while a thread has a group open on a communicator,
//! a call another thread makes on it joins that group and is launched by the group's end. So
//! [`group`] holds the call locks of all its communicators (in address order: no two groups
//! can deadlock) from before the start until every one has settled, and a call inside the
//! closure on a communicator the group was not given is refused: NCCL would hold it for the
//! group, out of the caller's sight.

use super::call_lock::CallGuard;
use super::communicator::Comm;
use crate::error::{Error, Result};
use crate::ffi::nccl::{nccl, Nccl};
use crate::ffi::nccl_sys as sys;
use std::cell::RefCell;

thread_local! {
    /// The communicators of the group this thread has open (their addresses), if any.
    static MEMBERS: RefCell<Option<Vec<usize>>> = const { RefCell::new(None) };
}

fn address(c: &Comm) -> usize {
    c as *const Comm as usize
}

/// Errors when this thread has a group open and `comm` is not one of its communicators.
pub(super) fn check_member(comm: &Comm) -> Result<()> {
    MEMBERS.with(|m| match &*m.borrow() {
        Some(members) if !members.contains(&address(comm)) => Err(Error::invalid(
            "comms",
            format!(
                "inside group(), a call on rank {}'s communicator, which was not passed to \
                 the group: NCCL would hold it for the group's end; pass it in `comms`",
                comm.rank()
            ),
        )),
        _ => Ok(()),
    })
}

/// This thread's group membership while a group is open; the enclosing one restored after.
struct Membership(Option<Vec<usize>>);

impl Membership {
    fn enter(comms: &[&Comm]) -> Membership {
        let mine = comms.iter().map(|c| address(c)).collect();
        Membership(MEMBERS.with(|m| m.replace(Some(mine))))
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        MEMBERS.with(|m| *m.borrow_mut() = self.0.take());
    }
}

/// An open `ncclGroupStart`, closed by [`Open::end`] or, if the closure panicked, on drop.
struct Open<'n> {
    nccl: &'n Nccl,
    ended: bool,
}

impl Open<'_> {
    fn end(mut self) -> Result<()> {
        self.ended = true;
        group_end(self.nccl)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = group_end(self.nccl);
        }
    }
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`, so that the operations it enqueues
/// on `comms` are issued together (needed for send/recv pairs and for several
/// communicators driven from one thread), then waits for the group to settle on each of
/// `comms`. Calls inside `f` may use only the communicators in `comms` (another is
/// [`Error::InvalidArgument`]); other threads' calls on them wait until the group has settled.
pub fn group<R>(comms: &[&Comm], f: impl FnOnce() -> Result<R>) -> Result<R> {
    let n = nccl()?;
    let mut ordered: Vec<&Comm> = comms.to_vec();
    ordered.sort_by_key(|c| address(c));
    ordered.dedup_by_key(|c| address(c));
    let _held: Vec<CallGuard<'_>> = ordered.iter().map(|c| c.calls().lock()).collect();
    let _membership = Membership::enter(&ordered);
    group_start(n)?;
    let open = Open {
        nccl: n,
        ended: false,
    };
    let result = f();
    let end = open.end();
    let r = result?;
    end?;
    for c in &ordered {
        c.settle("ncclGroupEnd", "the group to be issued")?;
    }
    Ok(r)
}

pub(super) fn group_start(n: &Nccl) -> Result<()> {
    let f = n.func("ncclGroupStart", &n.lib.ncclGroupStart)?;
    // SAFETY: no arguments; pairs with group_end.
    n.check("ncclGroupStart", unsafe { f() }, std::ptr::null_mut())
}

pub(super) fn group_end(n: &Nccl) -> Result<()> {
    let f = n.func("ncclGroupEnd", &n.lib.ncclGroupEnd)?;
    // SAFETY: closes the group opened by group_start.
    match unsafe { f() } {
        sys::ncclResult_t_ncclInProgress => Ok(()),
        rc => n.check("ncclGroupEnd", rc, std::ptr::null_mut()),
    }
}
