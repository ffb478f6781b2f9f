//! Opening safetensors checkpoints: one file, a directory (through its index, or every
//! `*.safetensors` in it), an index `.json`, and the parts of a sharded set, which are
//! never taken for the whole.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use super::{MAX_HEADER, parse, parse_index};
use crate::error::{CheckpointFault, Error, Result, quote};
use crate::model::files::{
    check_unique, display, in_file, open_file, parent_dir, part_name, read_grown,
};
use crate::model::{Checkpoint, CheckpointFile, Format, TensorInfo};

const INDEX_NAME: &str = "model.safetensors.index.json";

/// `(prefix, no, count)` from `prefix-00002-of-00003.safetensors` (no from 1).
fn shard_name(path: &Path) -> Option<(String, u64, u64)> {
    part_name(path, ".safetensors")
}

/// One `.safetensors` file: the whole checkpoint, unless its name says it is a part of a
/// set, which is opened through its index or refused.
pub(in crate::model) fn open_single(path: &Path) -> Result<Checkpoint> {
    let Some((prefix, no, count)) = shard_name(path).filter(|(_, _, count)| *count > 1) else {
        return open_files(vec![path.to_path_buf()]);
    };
    let index = parent_dir(path).join(format!("{prefix}.safetensors.index.json"));
    if !index.is_file() {
        return Err(Error::checkpoint(
            display(path),
            None,
            CheckpointFault::Split,
            format!(
                "part {no} of {count} of a sharded checkpoint, opened alone: its experts would \
                 be missing the tensors of the other parts; open the directory or {} (not \
                 found beside it)",
                index.display()
            ),
        ));
    }
    let checkpoint = open_index(&index)?;
    let name = path.file_name();
    if !checkpoint.files.iter().any(|f| f.path.file_name() == name) {
        return Err(Error::checkpoint(
            display(path),
            None,
            CheckpointFault::Split,
            format!(
                "part {no} of {count} of a sharded checkpoint, but {} beside it does not \
                 name this file",
                index.display()
            ),
        ));
    }
    Ok(checkpoint)
}

/// A directory: through its `model.safetensors.index.json` if it has one, else every
/// `*.safetensors` in it, each sharded set complete.
pub(in crate::model) fn open_dir(dir: &Path) -> Result<Checkpoint> {
    let index = dir.join(INDEX_NAME);
    if index.is_file() {
        return open_index(&index);
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("readdir", display(dir), e))?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("readdir", display(dir), e))?;
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) == Some("safetensors") {
            paths.push(path);
        }
    }
    if paths.is_empty() {
        return Err(Error::checkpoint(
            display(dir),
            None,
            CheckpointFault::Missing,
            format!("no {INDEX_NAME} and no *.safetensors file in the directory"),
        ));
    }
    paths.sort();
    check_shard_sets(dir, &paths)?;
    open_files(paths)
}

/// Every part of each `NAME-0000K-of-0000N.safetensors` set among `paths` is there.
fn check_shard_sets(dir: &Path, paths: &[PathBuf]) -> Result<()> {
    let mut sets: BTreeMap<(String, u64), BTreeSet<u64>> = BTreeMap::new();
    for path in paths {
        if let Some((prefix, no, count)) = shard_name(path) {
            sets.entry((prefix, count)).or_default().insert(no);
        }
    }
    for ((prefix, count), present) in sets {
        // At most |present| + 1 turns: the first part not present.
        let missing = (1..=count).find(|no| !present.contains(no));
        if let Some(no) = missing {
            return Err(Error::checkpoint(
                display(dir),
                None,
                CheckpointFault::Missing,
                format!(
                    "part {no} of {count} of {} is not in the directory (and there is no \
                     {INDEX_NAME}): the other parts alone are not the checkpoint",
                    quote(&format!("{prefix}-*-of-{count:05}.safetensors"))
                ),
            ));
        }
    }
    Ok(())
}

/// An index `.json` and the shards it names. The index is read whole, bounded like a
/// header.
pub(in crate::model) fn open_index(index: &Path) -> Result<Checkpoint> {
    let (file, len) = open_file(index)?;
    let name = display(index);
    if len > MAX_HEADER {
        return Err(Error::checkpoint(
            name,
            None,
            CheckpointFault::Header,
            format!("index of {len} bytes is larger than the {MAX_HEADER} byte cap"),
        ));
    }
    let bytes = read_grown(&file, 0, len).map_err(|e| Error::io("pread", &name, e))?;
    let weight_map = parse_index(&bytes, &name)?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let paths = shard_paths(dir, &weight_map, &name)?;
    let checkpoint = open_files(paths)?;
    check_weight_map(&checkpoint, &weight_map, &name)?;
    Ok(checkpoint)
}

/// The shards the index names, each once, in the order first named; each must exist.
fn shard_paths(dir: &Path, weight_map: &[(String, String)], name: &str) -> Result<Vec<PathBuf>> {
    let mut shard_names: Vec<&str> = Vec::new();
    let mut seen = HashSet::new();
    for (_, shard) in weight_map {
        if seen.insert(shard.as_str()) {
            shard_names.push(shard.as_str());
        }
    }
    let mut paths = Vec::with_capacity(shard_names.len());
    for shard in shard_names {
        let path = dir.join(shard);
        if !path.is_file() {
            let tensor = weight_map
                .iter()
                .find(|(_, s)| s == shard)
                .map(|(t, _)| t.as_str());
            return Err(Error::checkpoint(
                name,
                tensor,
                CheckpointFault::Missing,
                format!(
                    "the index names shard {}, which does not exist",
                    quote(shard)
                ),
            ));
        }
        paths.push(path);
    }
    Ok(paths)
}

/// Every tensor of the index is in the shard the index places it in.
fn check_weight_map(
    checkpoint: &Checkpoint,
    weight_map: &[(String, String)],
    name: &str,
) -> Result<()> {
    let by_name: HashMap<&str, &TensorInfo> = checkpoint
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    for (tensor, shard) in weight_map {
        let found = by_name
            .get(tensor.as_str())
            .map(|t| checkpoint.files[t.file].path.file_name() == Some(OsStr::new(shard)));
        if found != Some(true) {
            return Err(Error::checkpoint(
                name,
                Some(tensor),
                CheckpointFault::Missing,
                format!(
                    "the index places the tensor in {}, which does not hold it",
                    quote(shard)
                ),
            ));
        }
    }
    Ok(())
}

/// The checkpoint of exactly these files, in this order.
fn open_files(paths: Vec<PathBuf>) -> Result<Checkpoint> {
    let mut files = Vec::with_capacity(paths.len());
    let mut tensors = Vec::new();
    for (index, path) in paths.into_iter().enumerate() {
        let file = CheckpointFile::open(path)?;
        tensors.extend(in_file(parse(&file.file, &file.name())?, index));
        files.push(file);
    }
    check_unique(&files, &tensors)?;
    Ok(Checkpoint {
        format: Format::Safetensors,
        files,
        tensors,
        metadata: Vec::new(),
        config: None,
        heads: None,
    })
}
