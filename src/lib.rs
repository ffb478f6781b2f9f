//! numapin puts memory where it belongs on Linux NUMA machines, and proves that it did.
//!
//! It is for programs that load large read-mostly data (MoE expert weights, vector
//! indexes, buffer pools) and read it from every core:
//!
//! - [`NodeSet`] parses numactl's node strings and builds the kernel's mask words;
//! - [`MemPolicy`] with [`ModeFlags`] / [`MbindFlags`] is the typed `mbind` /
//!   `set_mempolicy` policy, and [`policy`] sets the calling thread's, also scoped;
//! - [`Region`] is an owned page-aligned mapping you bind *before* first touch, populate,
//!   lock, release and inspect ([`Region::placement`] asks the kernel where each page is);
//! - [`probe()`] says what this process may do here. In a container whose seccomp
//!   profile denies the NUMA calls (`EPERM`), or on a kernel without NUMA (`ENOSYS`),
//!   binding returns [`Placement::Degraded`]: the memory works, unplaced, and you are told.
//!   Every other errno is an [`Error`] that names the call, the errno and the arguments.
//!
//! # Example
//! ```
//! use numapin::{MbindFlags, MemPolicy, NodeSet, Observed, Region};
//!
//! let nodes = NodeSet::parse("all").unwrap();
//! let mut weights = Region::anonymous_aligned(4 << 20, 2 << 20).unwrap();
//! let placement = weights.bind(&MemPolicy::Interleave(nodes), MbindFlags::empty()).unwrap();
//! weights.populate_write().unwrap();
//! if let Observed::Known(histogram) = weights.placement().unwrap() {
//!     for (node, pages) in &histogram.pages {
//!         println!("node {node}: {pages} pages ({placement})");
//!     }
//! }
//! ```
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod capability;
pub mod diag;
mod error;
#[cfg(feature = "jemalloc")]
pub mod jemalloc;
#[cfg(feature = "model")]
pub mod model;
mod node;
pub mod policy;
mod probe;
mod region;
pub mod store;

pub use error::{CheckpointFault, Errno, Error, Result};
pub use node::{KernelMask, MAX_NODES, Node, NodeContext, NodeSet, possible_node_count};
pub use policy::{DegradeReason, MbindFlags, MemPolicy, ModeFlags, Observed, Placement};
pub use probe::{MempolicySupport, Support, ThpMode, mempolicy_support, probe};
pub use region::{
    Advice, HugePageSize, MoveReport, NodeHistogram, Region, Seals, bind_range, migrate_process,
};
pub use store::{ExpertSource, LayerReport, LayerSpec, Layout, PinStore, StoreOptions, StoreStats};

/// The base page size, read once.
pub fn page_size() -> usize {
    rustix::param::page_size()
}
