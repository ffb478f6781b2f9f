// The README is the crate's front page, and its Rust snippets are doc tests.
#![doc = include_str!("../README.md")]
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod cache;
mod calls;
#[doc(hidden)]
pub mod capability;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod cli;
pub mod diag;
mod error;
#[cfg(feature = "jemalloc")]
pub mod jemalloc;
#[cfg(feature = "model")]
pub mod model;
mod node;
mod nodeset;
mod page;
#[cfg(feature = "model")]
pub mod planner;
pub mod policy;
mod probe;
mod region;
pub mod routing;
pub mod serve;
mod source;
pub mod store;
pub mod topology;

pub use error::{CheckpointFault, Errno, Error, Invalid, Result, ServeFault};
pub use node::{KernelMask, NodeContext, possible_node_count};
pub use nodeset::{MAX_NODES, Node, NodeSet, NodeSetIter};
pub use page::page_size;
pub use probe::{
    MempolicySupport, Support, SyscallGroup, ThpMode, anon_vma_names_supported, group_support,
    mempolicy_support, page_calls_support, probe,
};
pub use region::{
    Advice, HugePageSize, MoveReport, NodeHistogram, PagesSource, Region, Seals, WriteWindow,
    bind_range, migrate_process, range_placement, resident_pages,
};

// The pages in docs/ that the README links to: their Rust snippets are doc tests too.
#[cfg(doctest)]
mod docs {
    #[doc = include_str!("../docs/api.md")]
    pub struct ApiDoctests;
    #[doc = include_str!("../docs/cache.md")]
    pub struct CacheDoctests;
    #[doc = include_str!("../docs/checkpoints.md")]
    pub struct CheckpointsDoctests;
    #[doc = include_str!("../docs/sharing.md")]
    pub struct SharingDoctests;
}
