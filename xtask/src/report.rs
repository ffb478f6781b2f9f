//! Test outcomes per environment and binary, and the table that prints them.

/// What one test binary did in one environment.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub env: String,
    pub binary: String,
    pub passed: usize,
    pub failed: usize,
    /// The binary's exit status was success.
    pub ok: bool,
    /// Tests that printed that they did not run here.
    pub not_run: usize,
    pub seconds: f64,
}

/// Sums the `test result:` lines of libtest output.
pub fn parse_counts(output: &str) -> (usize, usize) {
    let mut passed = 0;
    let mut failed = 0;
    for line in output.lines().filter(|l| l.contains("test result:")) {
        let number_before = |word: &str| {
            line.split(';')
                .find(|part| part.contains(word))
                .and_then(|part| part.split_whitespace().rev().nth(1)?.parse::<usize>().ok())
                .unwrap_or(0)
        };
        passed += number_before(" passed");
        failed += number_before(" failed");
    }
    (passed, failed)
}

pub fn count_not_run(output: &str) -> usize {
    output.lines().filter(|l| l.starts_with("NOT RUN:")).count()
}

pub fn print_table(title: &str, outcomes: &[Outcome]) {
    println!("\n{title}");
    println!(
        "{:<16} {:<24} {:>7} {:>7} {:>8} {:>8}  result",
        "environment", "binary", "passed", "failed", "not run", "seconds"
    );
    for o in outcomes {
        println!(
            "{:<16} {:<24} {:>7} {:>7} {:>8} {:>8.1}  {}",
            o.env,
            o.binary,
            o.passed,
            o.failed,
            o.not_run,
            o.seconds,
            if o.ok && o.failed == 0 {
                "ok"
            } else {
                "FAILED"
            }
        );
    }
    let passed: usize = outcomes.iter().map(|o| o.passed).sum();
    let failed = outcomes.iter().filter(|o| !o.ok || o.failed > 0).count();
    println!("total: {passed} tests passed; {failed} binaries failed");
}

pub fn all_ok(outcomes: &[Outcome]) -> bool {
    outcomes.iter().all(|o| o.ok && o.failed == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sum_over_result_lines() {
        let out = "test result: ok. 14 passed; 0 failed; 0 ignored;\nNOT RUN: x\n\
                   test result: FAILED. 3 passed; 2 failed; 1 ignored;";
        assert_eq!(parse_counts(out), (17, 2));
        assert_eq!(count_not_run(out), 1);
    }
}
