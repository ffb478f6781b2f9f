//! The number grammar of the crate's text forms (expert shares, slices, plans, node
//! lists): decimal digits, nothing else.

/// `text` as a decimal number: ASCII digits only, so no sign and no whitespace (Rust's
/// `from_str` takes a leading `+`, which no text form here means); `None` otherwise, and
/// when it does not fit `T`.
pub(crate) fn decimal<T: std::str::FromStr>(text: &str) -> Option<T> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}
