//! llama.cpp's split sets (`name-00001-of-0000N.gguf`, keys `split.no`, `split.count`,
//! `split.tensors.count`), and opening a GGUF checkpoint: one file, or the first part of
//! a split set and the parts found beside it.

use std::path::{Path, PathBuf};

use super::{GgufHeader, GgufValue, parse};
use crate::error::{CheckpointFault, Error, Result};
use crate::model::files::{check_unique, display, in_file, part_name};
use crate::model::{Checkpoint, CheckpointFile, Format, TensorInfo};

/// A `.gguf` file: the whole checkpoint, or the first part of a split set, whose other
/// parts are opened and checked against its `split.*` keys.
pub(in crate::model) fn open(path: &Path) -> Result<Checkpoint> {
    let first = CheckpointFile::open(path.to_path_buf())?;
    let GgufHeader {
        metadata, tensors, ..
    } = parse(&first.file, &first.name())?;
    let mut files = vec![first];
    let mut tensors = tensors;
    match split_info(&metadata, &display(path))? {
        None => refuse_unkeyed_part(path)?,
        Some(split) => open_parts(path, &split, &mut files, &mut tensors)?,
    }
    check_unique(&files, &tensors)?;
    Ok(Checkpoint {
        format: Format::Gguf,
        files,
        tensors,
        metadata,
        config: None,
        heads: None,
    })
}

/// A file without split keys whose name says it is one part of several.
fn refuse_unkeyed_part(path: &Path) -> Result<()> {
    match split_name(path) {
        Some((_, no, count)) if count > 1 => Err(Error::checkpoint(
            display(path),
            None,
            CheckpointFault::Split,
            format!("named part {no} of {count} but the file has no split.count key"),
        )),
        _ => Ok(()),
    }
}

/// The parts after the first (at `path`, with keys `split`), each checked against the
/// first; then the tensor count the first part states.
fn open_parts(
    path: &Path,
    split: &SplitInfo,
    files: &mut Vec<CheckpointFile>,
    tensors: &mut Vec<TensorInfo>,
) -> Result<()> {
    let paths = split_paths(path, split)?;
    for (no, part_path) in paths.into_iter().enumerate().skip(1) {
        let part = CheckpointFile::open(part_path)?;
        let name = part.name();
        let header = parse(&part.file, &name)?;
        let info = split_info(&header.metadata, &name)?;
        check_part(&name, info.as_ref(), no, split)?;
        tensors.extend(in_file(header.tensors, no));
        files.push(part);
    }
    match split.tensors {
        Some(total) if total != tensors.len() as u64 => Err(Error::checkpoint(
            display(path),
            None,
            CheckpointFault::Split,
            format!(
                "split.tensors.count is {total} but the {} parts hold {} tensors",
                split.count,
                tensors.len()
            ),
        )),
        _ => Ok(()),
    }
}

/// The `split.*` keys of one part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitInfo {
    /// `split.no`: this part, from 0.
    pub no: u64,
    /// `split.count`: how many parts.
    pub count: u64,
    /// `split.tensors.count`: tensors in all parts (the first part states it).
    pub tensors: Option<u64>,
}

/// The split keys, if the file has `split.count`.
///
/// # Errors
/// [`CheckpointFault::Header`] when a key is not a non-negative integer, `split.count` is
/// 0, or `split.no` is missing or not below `split.count`.
pub(crate) fn split_info(
    metadata: &[(String, GgufValue)],
    file: &str,
) -> Result<Option<SplitInfo>> {
    let get = |key: &str| -> Result<Option<u64>> {
        match metadata.iter().find(|(k, _)| k == key) {
            None => Ok(None),
            Some((_, v)) => v.as_u64().map(Some).ok_or_else(|| {
                Error::checkpoint(
                    file,
                    None,
                    CheckpointFault::Header,
                    format!("{key} is {}, not a non-negative integer", v.describe()),
                )
            }),
        }
    };
    let Some(count) = get("split.count")? else {
        return Ok(None);
    };
    let no = get("split.no")?;
    let tensors = get("split.tensors.count")?;
    match no {
        Some(no) if count > 0 && no < count => Ok(Some(SplitInfo { no, count, tensors })),
        _ => Err(Error::checkpoint(
            file,
            None,
            CheckpointFault::Header,
            format!(
                "split.count = {count}, split.no = {no:?}: the part number must be below the count"
            ),
        )),
    }
}

/// `(prefix, no, count)` from `prefix-00001-of-00003.gguf` (no from 1).
pub(crate) fn split_name(path: &Path) -> Option<(String, u64, u64)> {
    part_name(path, ".gguf")
}

/// The paths of every part, index = `split.no`, given the first part's path and keys.
///
/// # Errors
/// [`CheckpointFault::Split`] when `path` is not the first part or its name disagrees
/// with its keys; [`CheckpointFault::Missing`] naming the first part that does not exist.
pub fn split_paths(path: &Path, split: &SplitInfo) -> Result<Vec<PathBuf>> {
    let file = path.display().to_string();
    if split.no != 0 {
        return Err(Error::checkpoint(
            file,
            None,
            CheckpointFault::Split,
            format!("split.no is {}: open the first part (split.no 0)", split.no),
        ));
    }
    if split.count == 1 {
        return Ok(vec![path.to_path_buf()]);
    }
    let Some((prefix, no, count)) = split_name(path) else {
        return Err(Error::checkpoint(
            file,
            None,
            CheckpointFault::Split,
            format!(
                "split.count is {} but the name is not NAME-00001-of-{:05}.gguf",
                split.count, split.count
            ),
        ));
    };
    if no != 1 || count != split.count {
        return Err(Error::checkpoint(
            file,
            None,
            CheckpointFault::Split,
            format!(
                "the name says part {no} of {count}, the keys say part 1 of {}",
                split.count
            ),
        ));
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut paths = Vec::with_capacity(split.count.min(16) as usize);
    for i in 0..split.count {
        let part = dir.join(format!("{prefix}-{:05}-of-{:05}.gguf", i + 1, split.count));
        if !part.is_file() {
            return Err(Error::checkpoint(
                file,
                None,
                CheckpointFault::Missing,
                format!(
                    "split part {} of {} is missing: {}",
                    i + 1,
                    split.count,
                    part.display()
                ),
            ));
        }
        paths.push(part);
    }
    Ok(paths)
}

/// Checks part `no` (from 0) against the first part's keys.
///
/// # Errors
/// [`CheckpointFault::Split`] when the part has no split keys or they disagree.
pub(crate) fn check_part(
    file: &str,
    info: Option<&SplitInfo>,
    no: usize,
    first: &SplitInfo,
) -> Result<()> {
    let why = match info {
        None => "the part has no split.count key".to_owned(),
        Some(i) if i.count != first.count => format!(
            "split.count is {} but the first part says {}",
            i.count, first.count
        ),
        Some(i) if i.no != no as u64 => format!("split.no is {} in part {}", i.no, no + 1),
        Some(_) => return Ok(()),
    };
    Err(Error::checkpoint(file, None, CheckpointFault::Split, why))
}
