pub fn run() -> Result<(), String> {
    Err("test-numa: not yet".into())
}
