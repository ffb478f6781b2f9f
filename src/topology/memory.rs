//! The bytes a node can give a bound allocation: the one figure of free memory that the
//! planner ([`Machine::live`](crate::planner::Machine::live), through the probe's
//! [`Support::free_bytes`](crate::probe::Support::free_bytes)), the dry run's default plan
//! and the store's memory checks all read, so that a plan cannot call a layout fitting
//! that `place` then refuses, or the reverse.
//!
//! # Which per-node figure
//!
//! `MemFree + Inactive(file)` from `/sys/devices/system/node/nodeN/meminfo`. `MemFree`
//! alone leaves out the page cache, and loading a model fills the page cache with the
//! model file itself: a node whose memory is "used" by the file just read can still take
//! a replica, because the kernel drops those clean, inactive pages first when a bound
//! allocation needs room. `FilePages` (all page cache) would promise too much: active,
//! dirty and mapped file pages (the binaries, a shared model mapping in use) are not
//! given up quickly, and a bind that counts on them ends in reclaim storms or the OOM
//! killer. Anonymous memory (other processes' heaps) and swap are not counted.

use crate::error::{Error, Result};
use crate::node::Node;

/// The figure [`Error::NodeMemory`] compares against, in words.
pub(crate) const FIGURE: &str = "MemFree + Inactive(file) from the node's meminfo (free pages \
     plus the clean page cache the kernel reclaims first, such as the model file just read; \
     active, dirty or mapped cache is not counted)";

/// Bytes node `node` can give a bound allocation (see the module docs); `None` where sysfs
/// has no meminfo for it (a kernel without NUMA).
///
/// # Errors
/// The file exists but cannot be read or parsed.
pub(crate) fn available_bytes(node: Node) -> Result<Option<u64>> {
    let path = format!("/sys/devices/system/node/node{node}/meminfo");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("read", path, e)),
    };
    parse(&text, &path).map(Some)
}

/// `MemFree + Inactive(file)` of one node's meminfo text, bytes.
fn parse(text: &str, path: &str) -> Result<u64> {
    let field = |name: &'static str| -> Result<u64> {
        // "Node 0 MemFree:   123456 kB"
        text.lines()
            .find_map(|line| {
                let (_, rest) = line.split_once(name)?;
                rest.split_whitespace().next()?.parse::<u64>().ok()
            })
            .map(|kib| kib.saturating_mul(1024))
            .ok_or_else(|| Error::Unparsable {
                path: path.to_owned(),
                what: name,
                found: text.chars().take(64).collect(),
            })
    };
    Ok(field("MemFree:")?.saturating_add(field("Inactive(file):")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_pages_plus_the_inactive_file_cache() {
        let text = "Node 0 MemTotal:       8000 kB\nNode 0 MemFree:        1000 kB\n\
                    Node 0 Active(file):    500 kB\nNode 0 Inactive(file):  300 kB\n";
        assert_eq!(parse(text, "meminfo").unwrap(), 1300 * 1024);
        assert!(matches!(
            parse("Node 0 MemFree: 1 kB\n", "meminfo"),
            Err(Error::Unparsable {
                what: "Inactive(file):",
                ..
            })
        ));
    }
}
