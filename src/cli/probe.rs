//! `numapin probe`: what numapin finds on this machine, and one line saying what
//! placement does here (`--json`: one object).

use super::args::ProbeArgs;
use super::report::{ProbeJson, verdict};

pub(super) fn run(args: &ProbeArgs) -> Result<(), String> {
    let support = crate::probe::probe().map_err(|e| e.to_string())?;
    if args.json {
        let text =
            serde_json::to_string(&ProbeJson::new(&support)).map_err(|e| format!("JSON: {e}"))?;
        outln!("{text}");
    } else {
        outln!("{support}\n\n{}", verdict(&support));
    }
    Ok(())
}
