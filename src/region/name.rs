//! Names for anonymous mappings (`prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, …)`, Linux 5.17
//! with `CONFIG_ANON_VMA_NAME`): `/proc/PID/maps` then shows `[anon:numapin 3 L12
//! weights]` instead of a bare range, so an operator can tell which mapping is which
//! layer. Distribution kernels such as Ubuntu's build it in; Debian's cloud kernel and
//! many custom kernels do not, and answer `EINVAL` to any name.
//!
//! Two mappings merge only when their names are equal too, so each name the crate gives
//! is unique (a store number and a region number).

use std::ffi::CString;

use numapin_sys as sys;

use super::{Backing, Region};
use crate::error::{Errno, Error, Result};

/// Why `name` cannot name a mapping, or `None` when the kernel takes it: shorter than
/// [`sys::ANON_VMA_NAME_MAX_LEN`] (its NUL must fit too), printable ASCII, none of
/// `[ ] \ $` and backtick (the kernel's `is_valid_name_char`).
pub(crate) fn invalid_name_reason(name: &str) -> Option<String> {
    if name.len() >= sys::ANON_VMA_NAME_MAX_LEN {
        return Some(format!(
            "{} bytes; the kernel takes at most {}",
            name.len(),
            sys::ANON_VMA_NAME_MAX_LEN - 1
        ));
    }
    let bad = name
        .bytes()
        .position(|b| !(0x20..0x7f).contains(&b) || b"[]\\$`".contains(&b))?;
    Some(format!(
        "byte {bad} ({:#04x}) is not printable ASCII or is one of [ ] \\ $ `",
        name.as_bytes()[bad]
    ))
}

impl Region {
    /// Names this anonymous region's mapping (`prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME,
    /// addr, len, name)`): `/proc/self/maps` and `smaps` show `[anon:<name>]`. Returns
    /// `Ok(false)`, naming nothing, where the kernel has no anonymous mapping names
    /// (`CONFIG_ANON_VMA_NAME` off, or before Linux 5.17: it answers `EINVAL` to a name
    /// this function has already checked).
    ///
    /// Two neighbouring mappings with the same flags and policy merge unless their names
    /// differ: give each region a name of its own.
    ///
    /// # Errors
    /// The region is not private anonymous memory (memfd and file mappings carry their
    /// file's name), the name is 80 bytes or longer or holds a byte that is not printable
    /// ASCII or is one of `[ ] \ $` and backtick, or `prctl` fails with another errno.
    ///
    /// # Example
    /// ```
    /// let region = numapin::Region::anonymous_fenced(4096)?;
    /// if region.set_name("numapin example")? {
    ///     println!("see [anon:numapin example] in /proc/self/maps");
    /// }
    /// assert!(region.set_name("no [brackets]").is_err());
    /// # Ok::<(), numapin::Error>(())
    /// ```
    #[doc(alias = "PR_SET_VMA_ANON_NAME")]
    pub fn set_name(&self, name: &str) -> Result<bool> {
        const OP: &str = "Region::set_name";
        if !matches!(self.backing, Backing::Anonymous) {
            return Err(Error::wrong_backing(
                OP,
                "the region is not a private anonymous mapping",
                "a private anonymous mapping: only those can be named",
            ));
        }
        if let Some(why) = invalid_name_reason(name) {
            let shown: String = name.chars().take(100).collect();
            return Err(Error::bad_value(OP, "name", format!("{shown:?}"), why));
        }
        let c_name = CString::new(name)
            .map_err(|_| Error::bad_value(OP, "name", crate::error::quote(name), "holds a NUL"))?;
        // SAFETY: the range is this region's own mapping and `c_name` is NUL-terminated;
        // naming changes no memory.
        let named = unsafe {
            sys::prctl_set_vma_anon_name(self.as_ptr().cast(), self.map_len(), c_name.as_ptr())
        };
        match named {
            Ok(()) => Ok(true),
            Err(Errno::INVAL) => Ok(false),
            Err(e) => Err(Error::os(
                "prctl",
                e,
                format_args!(
                    "PR_SET_VMA_ANON_NAME addr={:p} len={} name={name:?}",
                    self.as_ptr(),
                    self.map_len()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_kernel_refuses_are_refused_first() {
        assert_eq!(invalid_name_reason("numapin 3 L12 weights"), None);
        assert_eq!(invalid_name_reason(&"x".repeat(79)), None);
        assert!(invalid_name_reason(&"x".repeat(80)).is_some());
        for bad in [
            "a[b",
            "a]b",
            "a\\b",
            "a$b",
            "a`b",
            "tab\there",
            "é",
            "nul\0",
        ] {
            let why = invalid_name_reason(bad);
            assert!(why.is_some(), "{bad:?}");
        }
        let region = Region::anonymous(crate::page::page_size()).unwrap();
        for bad in ["[anon]".to_string(), "x".repeat(80), "x".repeat(4 << 20)] {
            let e = region.set_name(&bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
            assert!(e.to_string().len() < 400, "{e}");
        }
    }

    #[test]
    fn the_answer_matches_the_probe_and_the_kernel_config() {
        let region = Region::anonymous(crate::page::page_size()).unwrap();
        let named = region.set_name("numapin unit test").unwrap();
        assert_eq!(named, crate::calls::anon_vma_names_supported());
        let (start, end) = (region.as_ptr() as usize, region.as_ptr() as usize + 4096);
        let maps = crate::diag::maps_entries_in(start, end).unwrap();
        let shown = maps
            .iter()
            .any(|m| m.path.as_deref() == Some("[anon:numapin unit test]"));
        // /proc/self/maps is the reference: the name shows exactly when it was set.
        assert_eq!(shown, named, "{maps:?}");
        // Where the running kernel's config is readable, it is a second reference.
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        if let Ok(config) = std::fs::read_to_string(format!("/boot/config-{}", release.trim())) {
            let built_in = config.lines().any(|l| l == "CONFIG_ANON_VMA_NAME=y");
            assert_eq!(named, built_in);
        }
    }
}
