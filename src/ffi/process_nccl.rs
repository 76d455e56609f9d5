//! The NCCL libraries mapped into this process, read from `/proc/self/maps`: an engine's NCCL
//! (linked or loaded) shows there, and a communicator is only valid in the library that made
//! it. A file is identified by the device and inode maps gives it, as the dynamic loader does
//! (two paths to one file are one library; a file replaced on disk while mapped, shown
//! `(deleted)`, is another). Identities are only compared among maps entries (never with
//! `stat`, which differs from maps on overlay file systems).

use std::path::Path;

/// One NCCL library mapped into the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MappedNccl {
    /// (device, inode) of the mapped file.
    pub(crate) id: (u64, u64),
    /// Its path as mapped (canonical where it still exists), `(deleted)` when replaced.
    pub(crate) path: String,
    /// Whether the mapped file was deleted or replaced (its path names another file now).
    pub(crate) deleted: bool,
}

/// The distinct NCCL libraries (`libnccl.so*`; NCCL's plugins `libnccl-net.so` and the like
/// are not NCCL) mapped into this process; `None` when `/proc/self/maps` cannot be read.
pub(crate) fn mapped() -> Option<Vec<MappedNccl>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    Some(parse(&maps))
}

/// [`mapped`] of a maps text.
pub(crate) fn parse(maps: &str) -> Vec<MappedNccl> {
    let mut found: Vec<MappedNccl> = Vec::new();
    for line in maps.lines() {
        let Some((dev, inode, path)) = fields(line) else {
            continue;
        };
        let (path, deleted) = match path.strip_suffix(" (deleted)") {
            Some(p) => (p, true),
            None => (path, false),
        };
        let is_nccl = Path::new(path)
            .file_name()
            .is_some_and(|f| f.to_string_lossy().starts_with("libnccl.so"));
        let Some(id) = identity(dev, inode) else {
            continue;
        };
        if !is_nccl || found.iter().any(|m| m.id == id) {
            continue;
        }
        let path = if deleted {
            format!("{path} (deleted)")
        } else {
            canonical(path)
        };
        found.push(MappedNccl { id, path, deleted });
    }
    found
}

/// (device, inode, path) of a maps line `address perms offset dev inode path`; the path may
/// hold spaces.
fn fields(line: &str) -> Option<(&str, &str, &str)> {
    let mut rest = line;
    let mut field = [""; 5];
    for f in &mut field {
        rest = rest.trim_start();
        let end = rest.find(char::is_whitespace)?;
        *f = &rest[..end];
        rest = &rest[end..];
    }
    let path = rest.trim();
    path.starts_with('/').then_some((field[3], field[4], path))
}

/// (device, inode) from maps' `major:minor` (hex) and inode.
fn identity(dev: &str, inode: &str) -> Option<(u64, u64)> {
    let (major, minor) = dev.split_once(':')?;
    let major = u64::from_str_radix(major, 16).ok()?;
    let minor = u64::from_str_radix(minor, 16).ok()?;
    Some(((major << 32) | minor, inode.parse().ok()?))
}

fn canonical(path: &str) -> String {
    std::fs::canonicalize(path)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| path.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_give_each_nccl_file_once() {
        let maps = "\
7f00-7f10 r--p 00000000 08:01 1234 /opt/my libs/libnccl.so.2.28.9
7f10-7f20 r-xp 00010000 08:01 1234 /opt/my libs/libnccl.so.2.28.9
7f20-7f30 r--p 00000000 08:01 1234 /opt/link/libnccl.so.2
7f30-7f40 r--p 00000000 08:01 99 /usr/lib/libnccl-net.so
7f40-7f50 r--p 00000000 103:02 777 /usr/lib/libnccl.so.2.21.5 (deleted)
7f50-7f60 rw-p 00000000 00:00 0
7f60-7f70 r--p 00000000 08:01 55 [heap]
";
        let found = parse(maps);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].id, ((8 << 32) | 1, 1234));
        assert!(found[0].path.ends_with("libnccl.so.2.28.9"), "{found:?}");
        assert!(found[0].path.contains("my libs"), "{found:?}");
        assert!(!found[0].deleted);
        assert_eq!(found[1].id, ((0x103 << 32) | 2, 777));
        assert!(found[1].deleted && found[1].path.ends_with("(deleted)"));
    }
}
