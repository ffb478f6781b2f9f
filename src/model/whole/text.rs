//! The text form of a [`PlacementPlan`](super::PlacementPlan): its items, and the quoting
//! that lets every name pattern be a key. A pattern that would read back as something
//! else bare (a key of its own: `norms`, `dense`; empty; with whitespace around it; with a
//! separator; starting with `"`) is written `"quoted"`, with `\` and `"` escaped, so that
//! the text form reads back as the same plan.

use std::fmt::{self, Write as _};

use super::classes::TensorClass;
use crate::error::{Error, Result, quote};

const OP: &str = "PlacementPlan";

/// One item of the text form.
pub(super) enum Item {
    /// `KEY=VALUE` as written, trimmed, not yet split at its `=` (KEY `experts`,
    /// `dense`, a class name or a bare pattern); or a part without `=` that has no
    /// item before it to continue.
    Bare(String),
    /// `"PATTERN"=VALUE`: a quoted name pattern, unescaped, and its value, trimmed.
    Quoted {
        /// The pattern.
        pattern: String,
        /// Its layout's text.
        value: String,
    },
}

impl Item {
    /// Appends a part that continues this item's node list (`dense=replicate:0,1`).
    fn continue_with(&mut self, part: &str) {
        let text = match self {
            Item::Bare(text) => text,
            Item::Quoted { value, .. } => value,
        };
        text.push(',');
        text.push_str(part);
    }
}

/// The items of `text`: parts separated by `,` or `;` (outside a quoted pattern) and
/// trimmed, empty ones skipped; a part without `=` that is not quoted continues the node
/// list of the item before it.
///
/// # Errors
/// A quoted pattern without its closing `"`, with an escape other than `\\` or `\"`, or
/// not followed by `=`.
pub(super) fn items(text: &str) -> Result<Vec<Item>> {
    let mut items: Vec<Item> = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let part = rest.trim_start();
        if let Some(quoted) = part.strip_prefix('"') {
            let (pattern, after) = unquote(quoted).ok_or_else(|| {
                bad_item(
                    part,
                    "a quoted pattern ends at an unescaped '\"' and escapes only '\\' and '\"'",
                )
            })?;
            let end = after.find([',', ';']).unwrap_or(after.len());
            let value = after[..end]
                .trim_start()
                .strip_prefix('=')
                .ok_or_else(|| bad_item(part, "a quoted pattern is followed by =LAYOUT"))?;
            items.push(Item::Quoted {
                pattern,
                value: value.trim().to_owned(),
            });
            rest = &after[end..];
        } else {
            let end = part.find([',', ';']).unwrap_or(part.len());
            let piece = part[..end].trim();
            if !piece.is_empty() {
                match items.last_mut() {
                    Some(last) if !piece.contains('=') => last.continue_with(piece),
                    _ => items.push(Item::Bare(piece.to_owned())),
                }
            }
            rest = &part[end..];
        }
        rest = rest.strip_prefix([',', ';']).unwrap_or(rest);
    }
    Ok(items)
}

/// The pattern quoted at the start of `text` (after its opening `"`), unescaped, and
/// the text after its closing `"`; `None` without a closing `"` or for an escape other
/// than `\\` and `\"`.
fn unquote(text: &str) -> Option<(String, &str)> {
    let mut pattern = String::new();
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((pattern, &text[i + 1..])),
            '\\' => match chars.next() {
                Some((_, c @ ('\\' | '"'))) => pattern.push(c),
                _ => return None,
            },
            c => pattern.push(c),
        }
    }
    None
}

fn bad_item(part: &str, why: &str) -> Error {
    Error::bad_value(OP, "plan item", quote(part), why)
}

/// Writes `pattern` as a key of the text form: bare where [`items`] reads it back as
/// the same pattern, else quoted.
pub(super) fn write_pattern(f: &mut fmt::Formatter<'_>, pattern: &str) -> fmt::Result {
    if reads_back_bare(pattern) {
        return f.write_str(pattern);
    }
    f.write_char('"')?;
    for c in pattern.chars() {
        if matches!(c, '"' | '\\') {
            f.write_char('\\')?;
        }
        f.write_char(c)?;
    }
    f.write_char('"')
}

/// Whether `pattern`, written bare as `pattern=LAYOUT`, reads back as a pattern equal
/// to it: not empty, not trimmed, not another key, no separator, no opening quote.
fn reads_back_bare(pattern: &str) -> bool {
    !pattern.is_empty()
        && pattern.trim() == pattern
        && !pattern.starts_with('"')
        && !pattern.contains([',', ';', '='])
        && pattern != "dense"
        && TensorClass::from_name(pattern).is_none()
}

#[cfg(test)]
mod tests {
    use super::super::{DenseLayout, PlacementPlan};
    use crate::node::Node;
    use crate::nodeset::NodeSet;
    use crate::store::Layout;
    use proptest::prelude::*;

    fn base() -> PlacementPlan {
        PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
    }

    /// Before the fix, each of these printed a plan that read back as another: a class's
    /// layout (`norms`, `experts`, `dense`), a trimmed pattern, or an error.
    #[test]
    fn patterns_named_like_keys_read_back_as_patterns() {
        let hostile = [
            "norms",
            "experts",
            "dense",
            "attention",
            "",
            " padded ",
            "\t",
            "a;b",
            "a,b",
            "k=v",
            "\"",
            "\"quoted\"",
            "back\\slash\\",
            "\\\"",
            "*\"x",
            "1",
        ];
        for pattern in hostile {
            let plan = base().pattern(pattern, DenseLayout::Bind(Node(0)));
            let text = plan.to_string();
            let back = base().apply(&text);
            assert_eq!(back.as_ref().ok(), Some(&plan), "{pattern:?} as {text:?}");
            assert_eq!(back.unwrap().patterns()[0].0, pattern, "{text:?}");
        }
    }

    #[test]
    fn hand_written_quotes() {
        let plan = base()
            .apply(r#"  "norms" = bind:0 , "a\"b\\" =replicate:0,"x;y=z"=unplaced"#)
            .unwrap();
        let patterns: Vec<&str> = plan.patterns().iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(patterns, ["norms", "a\"b\\", "x;y=z"]);
        assert_eq!(
            plan.layout_of(super::TensorClass::NormsAndRouters),
            DenseLayout::Unplaced
        );
        for junk in [
            r#""open=bind:0"#,
            r#""a\x"=bind:0"#,
            r#""a" bind:0"#,
            r#""a"x=bind:0"#,
            "\"a\\",
        ] {
            assert!(base().apply(junk).is_err(), "{junk}");
        }
    }

    fn dense_layout() -> impl Strategy<Value = DenseLayout> {
        let zero = NodeSet::from_nodes([0]).unwrap();
        prop_oneof![
            Just(DenseLayout::Unplaced),
            Just(DenseLayout::Replicate(zero)),
            Just(DenseLayout::Interleave(zero)),
            any::<u16>().prop_map(|n| DenseLayout::Bind(Node(n))),
        ]
    }

    /// Patterns from the characters that mean something in the text form, the keys
    /// themselves, and anything else.
    fn pattern() -> impl Strategy<Value = String> {
        prop_oneof![
            "[ \t\n,;=\"\\\\*?a-z.]{0,12}",
            Just("norms".to_owned()),
            Just("experts".to_owned()),
            Just("dense".to_owned()),
            Just(String::new()),
            ".{0,12}",
        ]
    }

    proptest! {
        /// Display, then apply, gives an equal plan with the same patterns, whatever
        /// they are.
        #[test]
        fn the_text_form_round_trips(
            patterns in proptest::collection::vec((pattern(), dense_layout()), 0..6),
            layout in dense_layout(),
        ) {
            let mut plan = PlacementPlan::new(Layout::Unplaced, layout);
            for (p, l) in patterns {
                plan = plan.pattern(p, l);
            }
            let text = plan.to_string();
            let back = base().apply(&text);
            prop_assert_eq!(back.as_ref().ok(), Some(&plan), "{:?}", text);
            let back = back.unwrap();
            prop_assert_eq!(back.patterns(), plan.patterns());
        }

        /// Any text either is refused or reads as a plan whose text form reads back as
        /// it (no panic, and no text the parser takes that Display cannot write back).
        #[test]
        fn any_text_that_parses_reads_back(
            parts in proptest::collection::vec(
                prop_oneof![
                    "[ ,;=\"\\*a0:]{0,6}",
                    Just("experts=".to_owned()),
                    Just("dense=".to_owned()),
                    Just("norms=".to_owned()),
                    Just("bind:0".to_owned()),
                    Just("replicate:0".to_owned()),
                    Just("unplaced".to_owned()),
                    Just("split:0".to_owned()),
                ],
                0..8,
            ),
        ) {
            let text: String = parts.concat();
            if let Ok(plan) = base().apply(&text) {
                let written = plan.to_string();
                let back = base().apply(&written);
                prop_assert_eq!(back.as_ref().ok(), Some(&plan), "{:?} as {:?}", text, written);
            }
        }
    }
}

#[cfg(test)]
mod plan_tests {
    use super::super::plan::{DenseLayout, PlacementPlan};
    use super::TensorClass;
    use crate::node::Node;
    use crate::store::Layout;

    #[test]
    fn text_form_round_trips_and_refuses_junk() {
        let base = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced);
        let plan = base
            .clone()
            .apply("experts=split:0;dense=replicate:0,norms=bind:0;*.q_proj.*=interleave:0")
            .unwrap();
        assert_eq!(base.clone().apply(&plan.to_string()).unwrap(), plan);
        assert_eq!(
            plan.layout_of(TensorClass::NormsAndRouters),
            DenseLayout::Bind(Node(0))
        );
        assert_eq!(plan.patterns().len(), 1);
        for junk in [
            "experts",
            "=x",
            "dense=sideways:0",
            "experts=split",
            "attention=bind:x",
        ] {
            assert!(base.clone().apply(junk).is_err(), "{junk}");
        }
    }
}
