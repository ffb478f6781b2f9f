//! Support for numapin's tests, benchmarks and examples, kept out of the library: the
//! strategy `PinStore` replaces ([`baseline::SlabPerExpert`], which holds `unsafe`
//! `posix_memalign` code) and a deterministic synthetic model file
//! ([`synthetic::SyntheticModel`]).
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod baseline;
pub mod cache;
pub mod scratch;
/// The synthetic model, which `numapin place` writes too (`numapin::cli::synthetic`).
pub use numapin::cli::synthetic;
