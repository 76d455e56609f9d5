//! Loads NCCL at run time and checks its version.
//!
//! Search order: the path in `TPFUSE_NCCL_LIB` (only that, when set); then an NCCL library
//! already in the process (an engine's, linked or loaded: a communicator is only valid in the
//! library that made it, so tpfuse calls the one the engine uses); then `libnccl.so.2` (what
//! the nvidia-nccl wheels ship) and `libnccl.so` through the dynamic loader.

use super::nccl_sys::{self, NcclLib};
use super::process_nccl::{self, MappedNccl};
use crate::error::{Error, Result};
use std::ffi::CStr;
use std::sync::OnceLock;

/// The oldest NCCL tpfuse accepts (buffer registration, non-blocking init, abort).
pub(crate) const MIN_VERSION: (u32, u32) = (2, 19);
const MIN_VERSION_TEXT: &str = "2.19";

/// A loaded NCCL library.
pub(crate) struct Nccl {
    pub(crate) lib: NcclLib,
    pub(crate) path: String,
    pub(crate) version: (u32, u32, u32),
}

// Load failures are kept as text so that every call reports the same error.
enum LoadFailure {
    NotFound { tried: String, reason: String },
    TooOld { found: String, path: String },
}

static NCCL: OnceLock<std::result::Result<Nccl, LoadFailure>> = OnceLock::new();

/// The process-wide NCCL, loaded on first use.
pub(crate) fn nccl() -> Result<&'static Nccl> {
    match NCCL.get_or_init(load) {
        Ok(n) => Ok(n),
        Err(LoadFailure::NotFound { tried, reason }) => Err(Error::NcclNotFound {
            tried: tried.clone(),
            reason: reason.clone(),
        }),
        Err(LoadFailure::TooOld { found, path }) => Err(Error::NcclTooOld {
            found: found.clone(),
            path: path.clone(),
            required: MIN_VERSION_TEXT,
        }),
    }
}

fn candidates() -> Vec<String> {
    match std::env::var("TPFUSE_NCCL_LIB") {
        Ok(p) if !p.trim().is_empty() => vec![p],
        _ => {
            // An NCCL already in the process first (dlopen of its path returns it), unless its
            // file was replaced on disk (the path would load the new file beside it).
            let mut names: Vec<String> = process_nccl::mapped()
                .unwrap_or_default()
                .into_iter()
                .filter(|m| !m.deleted)
                .map(|m| m.path)
                .collect();
            names.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
            names
        }
    }
}

/// The NCCL an engine's communicator was made by: tpfuse's NCCL, provided it is the only NCCL
/// library mapped in the process (so the engine's is the same). Several, none, or a process
/// whose maps cannot be read is [`Error::NcclLibraryMismatch`]. Best-effort: an NCCL linked
/// statically into the engine, or under another file name, is not seen.
pub(crate) fn nccl_of_the_process() -> Result<&'static Nccl> {
    let unreadable = || {
        Error::NcclLibraryMismatch(
            "/proc/self/maps cannot be read, so tpfuse cannot tell which NCCL made the \
             communicator"
                .into(),
        )
    };
    if process_nccl::mapped().ok_or_else(unreadable)?.is_empty() {
        return Err(Error::NcclLibraryMismatch(
            "no NCCL library is loaded in this process (the communicator must come from a \
             libnccl.so the process loaded or links; NCCL linked statically into the engine \
             cannot be called by tpfuse)"
                .into(),
        ));
    }
    let n = nccl()?;
    the_only_nccl(&n.path, &process_nccl::mapped().ok_or_else(unreadable)?)?;
    Ok(n)
}

/// Errors unless one NCCL library is mapped (tpfuse's, `ours`, which is loaded).
fn the_only_nccl(ours: &str, mapped: &[MappedNccl]) -> Result<()> {
    if mapped.len() == 1 {
        return Ok(());
    }
    let all: Vec<&str> = mapped.iter().map(|m| m.path.as_str()).collect();
    Err(Error::NcclLibraryMismatch(format!(
        "tpfuse uses {ours}, and the process maps {} NCCL libraries ({}): a communicator is \
         only valid in the library that made it. Load one NCCL (set TPFUSE_NCCL_LIB to the \
         engine's before tpfuse's first NCCL call)",
        mapped.len(),
        all.join(", ")
    )))
}

fn load() -> std::result::Result<Nccl, LoadFailure> {
    let tried = candidates();
    let mut reason = String::from("no candidate");
    for name in &tried {
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        match unsafe { NcclLib::new(name.as_str()) } {
            Ok(lib) => {
                let path = loaded_path(&lib).unwrap_or_else(|| name.clone());
                let version = query_version(&lib).map_err(|reason| LoadFailure::NotFound {
                    tried: name.clone(),
                    reason,
                })?;
                if (version.0, version.1) < MIN_VERSION {
                    return Err(LoadFailure::TooOld {
                        found: format!("{}.{}.{}", version.0, version.1, version.2),
                        path,
                    });
                }
                return Ok(Nccl { lib, path, version });
            }
            Err(e) => reason = e.to_string(),
        }
    }
    Err(LoadFailure::NotFound {
        tried: tried.join(", "),
        reason,
    })
}

fn query_version(lib: &NcclLib) -> std::result::Result<(u32, u32, u32), String> {
    let get = lib
        .ncclGetVersion
        .as_ref()
        .map_err(|e| format!("ncclGetVersion is missing: {e}"))?;
    let mut code = 0i32;
    // SAFETY: ncclGetVersion writes one int; it needs no GPU.
    let rc = unsafe { get(&mut code) };
    if rc != nccl_sys::ncclResult_t_ncclSuccess {
        return Err(format!("ncclGetVersion returned {rc}"));
    }
    let code = code.max(0) as u32;
    // Since 2.9 the code is major*10000 + minor*100 + patch.
    Ok((code / 10000, (code / 100) % 100, code % 100))
}

/// The file the dynamic loader chose, from the address of one of its symbols.
fn loaded_path(lib: &NcclLib) -> Option<String> {
    let f = lib.ncclGetVersion.as_ref().ok()?;
    let mut info = libc_dl_info::DlInfo::default();
    // SAFETY: dladdr only reads the loader's tables for a valid code address.
    let ok = unsafe { libc_dl_info::dladdr(*f as *const std::ffi::c_void, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated path owned by the loader.
    let path = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(path.to_string_lossy().into_owned())
}

/// The one libc call tpfuse needs that std does not wrap.
mod libc_dl_info {
    use std::ffi::{c_char, c_int, c_void};

    #[repr(C)]
    pub struct DlInfo {
        pub dli_fname: *const c_char,
        pub dli_fbase: *mut c_void,
        pub dli_sname: *const c_char,
        pub dli_saddr: *mut c_void,
    }

    impl Default for DlInfo {
        fn default() -> Self {
            DlInfo {
                dli_fname: std::ptr::null(),
                dli_fbase: std::ptr::null_mut(),
                dli_sname: std::ptr::null(),
                dli_saddr: std::ptr::null_mut(),
            }
        }
    }

    extern "C" {
        pub fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
    }
}

impl Nccl {
    /// `ncclGetErrorString(result)`.
    pub(crate) fn error_string(&self, result: nccl_sys::ncclResult_t) -> String {
        match self.lib.ncclGetErrorString.as_ref() {
            // SAFETY: returns a static string for any result value.
            Ok(f) => unsafe { cstr_or_empty(f(result)) },
            Err(_) => String::new(),
        }
    }

    /// `ncclGetLastError(comm)`; `comm` may be null.
    pub(crate) fn last_error(&self, comm: nccl_sys::ncclComm_t) -> String {
        match self.lib.ncclGetLastError.as_ref() {
            // SAFETY: returns a string owned by NCCL, valid until the next NCCL call.
            Ok(f) => unsafe { cstr_or_empty(f(comm)) },
            Err(_) => String::new(),
        }
    }

    /// Turns an `ncclResult_t` into `Ok` or a typed [`Error::Nccl`].
    pub(crate) fn check(
        &self,
        call: &'static str,
        result: nccl_sys::ncclResult_t,
        comm: nccl_sys::ncclComm_t,
    ) -> Result<()> {
        if result == nccl_sys::ncclResult_t_ncclSuccess {
            return Ok(());
        }
        Err(Error::Nccl {
            call,
            result,
            message: self.error_string(result),
            last: self.last_error(comm),
        })
    }

    /// The function `f` of the library, or an error naming it.
    pub(crate) fn func<'a, F>(
        &self,
        name: &'static str,
        f: &'a std::result::Result<F, libloading::Error>,
    ) -> Result<&'a F> {
        f.as_ref().map_err(|e| Error::NcclNotFound {
            tried: self.path.clone(),
            reason: format!("{name} is missing from this NCCL: {e}"),
        })
    }
}

unsafe fn cstr_or_empty(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapped(path: &str, inode: u64) -> MappedNccl {
        MappedNccl {
            id: (8, inode),
            path: path.to_string(),
            deleted: false,
        }
    }

    #[test]
    fn an_engines_communicator_needs_the_one_nccl_of_the_process() {
        let ours = "/opt/nccl/libnccl.so.2.28.9";
        assert!(the_only_nccl(ours, &[mapped(ours, 1)]).is_ok());
        let two = [mapped(ours, 1), mapped("/usr/lib/libnccl.so.2.21.5", 2)];
        let err = the_only_nccl(ours, &two).unwrap_err().to_string();
        assert!(err.contains("/usr/lib/libnccl.so.2.21.5"), "{err}");
        assert!(err.contains("TPFUSE_NCCL_LIB"), "{err}");
    }

    #[test]
    fn the_loaded_nccl_is_found_in_the_process() {
        // Whatever NCCL this machine has (the wheel here, through TPFUSE_NCCL_LIB): once
        // loaded, it is the process's one NCCL library, and a second load would find it
        // first.
        let n = nccl().expect("NCCL loads (scripts/setup.sh installs it)");
        let found = process_nccl::mapped().expect("/proc/self/maps");
        assert_eq!(found.len(), 1, "{found:?}");
        let canonical = std::fs::canonicalize(&n.path).unwrap();
        assert_eq!(found[0].path, canonical.to_string_lossy(), "{found:?}");
        let first = candidates();
        assert!(
            std::env::var("TPFUSE_NCCL_LIB").is_ok() || first[0] == found[0].path,
            "{first:?}"
        );
        assert!(nccl_of_the_process().is_ok());
    }
}
