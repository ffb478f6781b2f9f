//! What the model's own config says about its experts, to notice a MoE layer missing
//! from the files entirely (a lone shard, a half-copied directory) and a layer with too
//! few experts: `config.json` beside a safetensors checkpoint (Hugging Face's), or a
//! GGUF's `{arch}.expert_count`.
//!
//! Read defensively: a config is an unrelated file a user may not control, so a
//! `config.json` that is missing, not a regular file, larger than [`MAX_CONFIG`], not
//! JSON, or whose keys are absent, of the wrong type or hold values this reader does not
//! model (a layout key it does not know, a frequency of 0) gives no check at all, never
//! an error of its own. The layer walk visits at most as many layers as the plan holds
//! (plus `mlp_only_layers`), whatever `num_hidden_layers` says.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::Path;

use serde_json::Value;

use super::gguf::GgufValue;
use super::naming::ExpertPlan;
use crate::error::{CheckpointFault, Error, Result};

/// The largest `config.json` read: 1 MiB (real ones are a few KiB).
pub const MAX_CONFIG: u64 = 1 << 20;

/// Keys that place MoE layers in ways this reader does not model: with one of them, the
/// layers are not checked.
const UNMODELLED: [&str; 9] = [
    "expert_layer_period",
    "expert_layer_offset",
    "num_dense_layers",
    "interleave_moe_layer_step",
    "moe_layer_start_index",
    "moe_layer_end_index",
    "moe_layer_interval",
    "mlp_layer_types",
    "moe_layers",
];

/// Keys that give the routed experts per layer, in the order tried.
const EXPERT_KEYS: [&str; 3] = ["n_routed_experts", "num_local_experts", "num_experts"];

/// Which layers are MoE layers: `l < count`, `l >= first_dense`, `l % freq == 0`
/// (DeepSeek's `moe_layer_freq`), `(l + 1) % step == 0` (Qwen's `decoder_sparse_step`),
/// `l` not in `mlp_only`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LayerRule {
    count: u64,
    first_dense: u64,
    freq: u64,
    step: u64,
    mlp_only: BTreeSet<u64>,
}

impl LayerRule {
    /// The first MoE layer at or after `from`. Each step moves forward; a skip over
    /// `mlp_only` consumes one of its entries, so this ends.
    fn next_moe(&self, from: u64) -> Option<u64> {
        let mut l = from.max(self.first_dense);
        loop {
            l = l.checked_next_multiple_of(self.freq)?;
            l = l.checked_add(1)?.checked_next_multiple_of(self.step)? - 1;
            if l >= self.count {
                return None;
            }
            if !self.mlp_only.contains(&l) {
                return Some(l);
            }
            l = l.checked_add(1)?;
        }
    }

    fn describe(&self) -> String {
        let mut out = format!("num_hidden_layers {}", self.count);
        if self.first_dense > 0 {
            out.push_str(&format!(", first_k_dense_replace {}", self.first_dense));
        }
        if self.freq > 1 {
            out.push_str(&format!(", moe_layer_freq {}", self.freq));
        }
        if self.step > 1 {
            out.push_str(&format!(", decoder_sparse_step {}", self.step));
        }
        if !self.mlp_only.is_empty() {
            out.push_str(&format!(", {} mlp_only_layers", self.mlp_only.len()));
        }
        out
    }
}

/// The model's config, as far as it concerns the experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ModelConfig {
    /// The file it came from (for errors).
    file: String,
    /// Routed experts per MoE layer, and the key that said so.
    experts: Option<(u64, String)>,
    /// Which layers are MoE layers (only with `experts`).
    layers: Option<LayerRule>,
}

fn u64_key(config: &serde_json::Map<String, Value>, key: &str, default: u64) -> Option<u64> {
    match config.get(key) {
        None => Some(default),
        Some(v) => v.as_u64(),
    }
}

impl ModelConfig {
    /// `dir/config.json`, if it is there and understood.
    pub(crate) fn read(dir: &Path) -> Option<ModelConfig> {
        let (bytes, file) = read_config(dir)?;
        ModelConfig::parse(&bytes, file)
    }
}

/// `(num_attention_heads, num_key_value_heads)` of `dir/config.json` (top level, else
/// its `text_config`; the KV heads default to the attention heads), if it says.
pub(crate) fn attention_heads(dir: &Path) -> Option<(u64, u64)> {
    let (bytes, _) = read_config(dir)?;
    let value: Value = serde_json::from_slice(&bytes).ok()?;
    let heads = |config: &Value| {
        let attention = config.get("num_attention_heads")?.as_u64()?;
        let kv = match config.get("num_key_value_heads") {
            Some(v) => v.as_u64()?,
            None => attention,
        };
        Some((attention, kv)).filter(|&(a, k)| a > 0 && k > 0)
    };
    heads(&value).or_else(|| heads(value.get("text_config")?))
}

/// The bytes of `dir/config.json` and its path: a regular file of at most
/// [`MAX_CONFIG`] bytes, else `None`.
fn read_config(dir: &Path) -> Option<(Vec<u8>, String)> {
    {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join("config.json");
        let meta = std::fs::metadata(&path).ok()?;
        if !meta.is_file() || meta.len() > MAX_CONFIG {
            return None;
        }
        // O_NONBLOCK: the file may have become a FIFO since the stat.
        let file = std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .ok()?;
        let mut bytes = Vec::new();
        file.take(MAX_CONFIG + 1).read_to_end(&mut bytes).ok()?;
        if bytes.len() as u64 > MAX_CONFIG {
            return None;
        }
        Some((bytes, path.display().to_string()))
    }
}

impl ModelConfig {
    fn parse(bytes: &[u8], file: String) -> Option<ModelConfig> {
        let value: Value = serde_json::from_slice(bytes).ok()?;
        let config = value.as_object()?;
        let experts = EXPERT_KEYS
            .iter()
            .find_map(|&k| {
                let n = config.get(k)?.as_u64()?;
                Some((n, k.to_owned()))
            })
            .or_else(|| {
                // DBRX nests it.
                let n = config.get("ffn_config")?.get("moe_num_experts")?.as_u64()?;
                Some((n, "ffn_config.moe_num_experts".to_owned()))
            });
        let experts = experts.filter(|(n, _)| *n > 0)?;
        Some(ModelConfig {
            file,
            layers: Self::layer_rule(config),
            experts: Some(experts),
        })
    }

    fn layer_rule(config: &serde_json::Map<String, Value>) -> Option<LayerRule> {
        if UNMODELLED.iter().any(|k| config.contains_key(*k)) {
            return None;
        }
        let count = config.get("num_hidden_layers")?.as_u64()?;
        let first_dense = u64_key(config, "first_k_dense_replace", 0)?;
        let freq = u64_key(config, "moe_layer_freq", 1)?;
        let step = u64_key(config, "decoder_sparse_step", 1)?;
        // Both at once is no model seen; 0 would be a division by zero in the model code.
        if freq == 0 || step == 0 || (freq > 1 && step > 1) {
            return None;
        }
        let mlp_only = match config.get("mlp_only_layers") {
            None | Some(Value::Null) => BTreeSet::new(),
            Some(Value::Array(a)) => a.iter().map(Value::as_u64).collect::<Option<_>>()?,
            Some(_) => return None,
        };
        Some(LayerRule {
            count,
            first_dense,
            freq,
            step,
            mlp_only,
        })
    }

    /// A GGUF's `{general.architecture}.expert_count`, if it has one.
    pub(crate) fn from_gguf(metadata: &[(String, GgufValue)], file: &Path) -> Option<ModelConfig> {
        let get = |key: &str| metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        let arch = get("general.architecture")?.as_str()?;
        if arch.len() > 64 {
            return None;
        }
        let key = format!("{arch}.expert_count");
        let n = get(&key)?.as_u64().filter(|&n| n > 0)?;
        Some(ModelConfig {
            file: file.display().to_string(),
            experts: Some((n, key)),
            layers: None,
        })
    }

    /// The routed experts per MoE layer the config gives.
    pub(crate) fn experts(&self) -> Option<u64> {
        self.experts.as_ref().map(|(n, _)| *n)
    }

    /// Every MoE layer the config names is in `plan`, with the experts it says.
    pub(crate) fn check(&self, plan: &ExpertPlan) -> Result<()> {
        if let Some(rule) = &self.layers {
            let present: BTreeSet<u64> = plan.layers().iter().map(|l| l.layer() as u64).collect();
            let mut from = 0u64;
            // Each turn that does not return finds a distinct layer of the plan.
            while let Some(l) = rule.next_moe(from) {
                if !present.contains(&l) {
                    return Err(Error::checkpoint(
                        &self.file,
                        None,
                        CheckpointFault::Missing,
                        format!(
                            "layer {l} is a MoE layer by this config ({}) but the checkpoint \
                             has no expert tensor of it (MoE layers found: {})",
                            rule.describe(),
                            layer_list(&present)
                        ),
                    ));
                }
                let Some(next) = l.checked_add(1) else { break };
                from = next;
            }
        }
        if let Some((want, key)) = &self.experts {
            for layer in plan.layers() {
                let have = layer.experts().len() as u64;
                if have != *want {
                    let kind = if have < *want {
                        CheckpointFault::Missing
                    } else {
                        CheckpointFault::Shape
                    };
                    return Err(Error::checkpoint(
                        &self.file,
                        None,
                        kind,
                        format!(
                            "layer {} has {have} experts in the checkpoint, {key} says {want}",
                            layer.layer()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// `1, 2, 3 … (61 layers)`: at most eight numbers.
fn layer_list(layers: &BTreeSet<u64>) -> String {
    let shown: Vec<String> = layers.iter().take(8).map(u64::to_string).collect();
    if layers.len() > shown.len() {
        format!("{} … ({} layers)", shown.join(", "), layers.len())
    } else if shown.is_empty() {
        "none".to_owned()
    } else {
        shown.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(json: &str) -> Option<LayerRule> {
        ModelConfig::parse(json.as_bytes(), "c".into())?.layers
    }

    fn moe_layers(r: &LayerRule, limit: usize) -> Vec<u64> {
        let mut out = Vec::new();
        let mut from = 0;
        while let Some(l) = r.next_moe(from) {
            out.push(l);
            if out.len() == limit {
                break;
            }
            from = l + 1;
        }
        out
    }

    #[test]
    fn deepseek_qwen_and_mixtral_rules() {
        let ds = rule(r#"{"num_hidden_layers":6,"first_k_dense_replace":2,"moe_layer_freq":2,"n_routed_experts":8}"#).unwrap();
        assert_eq!(moe_layers(&ds, 10), [2, 4]);
        let qwen = rule(r#"{"num_hidden_layers":6,"decoder_sparse_step":2,"num_experts":4,"mlp_only_layers":[3]}"#).unwrap();
        assert_eq!(moe_layers(&qwen, 10), [1, 5]);
        let mixtral = rule(r#"{"num_hidden_layers":3,"num_local_experts":8}"#).unwrap();
        assert_eq!(moe_layers(&mixtral, 10), [0, 1, 2]);
    }

    #[test]
    fn hostile_configs_give_no_rule_and_never_loop() {
        // Not understood: no check.
        for json in [
            r#"{"num_hidden_layers":"3","num_experts":4}"#,
            r#"{"num_hidden_layers":3,"num_experts":4,"moe_layer_freq":0}"#,
            r#"{"num_hidden_layers":3,"num_experts":4,"moe_layer_freq":2,"decoder_sparse_step":2}"#,
            r#"{"num_hidden_layers":3,"num_experts":4,"mlp_only_layers":["x"]}"#,
            r#"{"num_hidden_layers":3,"num_experts":4,"interleave_moe_layer_step":2}"#,
            r#"{"num_hidden_layers":-1,"num_experts":4}"#,
            r#"{"num_hidden_layers":1e300,"num_experts":4}"#,
        ] {
            assert_eq!(rule(json), None, "{json}");
        }
        assert_eq!(ModelConfig::parse(b"[1]", "c".into()), None);
        assert_eq!(ModelConfig::parse(b"{", "c".into()), None);
        assert_eq!(
            ModelConfig::parse(br#"{"num_experts":0}"#, "c".into()),
            None
        );
        // Huge but valid: the walk ends at the edges of u64.
        let huge = rule(r#"{"num_hidden_layers":18446744073709551615,"first_k_dense_replace":18446744073709551615,"num_experts":4}"#).unwrap();
        assert_eq!(moe_layers(&huge, 3), Vec::<u64>::new());
        let huge = rule(r#"{"num_hidden_layers":18446744073709551615,"moe_layer_freq":9223372036854775808,"num_experts":4}"#).unwrap();
        assert_eq!(moe_layers(&huge, 3), [0, 1 << 63]);
        let huge = rule(r#"{"num_hidden_layers":18446744073709551615,"decoder_sparse_step":18446744073709551615,"num_experts":4}"#).unwrap();
        assert_eq!(moe_layers(&huge, 3), [u64::MAX - 1]);
    }
}
