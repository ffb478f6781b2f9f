//! Prints what numapin finds on this machine: `cargo run --example probe`.

fn main() {
    match numapin::probe() {
        Ok(support) => println!("{support}"),
        Err(e) => {
            eprintln!("probe failed: {e}");
            std::process::exit(1);
        }
    }
}
