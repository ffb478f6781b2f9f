//! The base page size: every module that rounds a length or checks an alignment asks here.

/// The base page size (`sysconf(_SC_PAGESIZE)`, from the auxiliary vector), read once.
pub fn page_size() -> usize {
    rustix::param::page_size()
}
