// Wired in by the train command (issue 3); until then nothing calls it.
#[allow(dead_code, unused_imports)]
mod data;

fn main() {}
