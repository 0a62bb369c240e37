//! Generates the Rust readers and builders for `capnp/pcp.capnp` with Debian's `capnp`.

fn main() {
    println!("cargo:rerun-if-changed=capnp/pcp.capnp");
    let result = capnpc::CompilerCommand::new()
        .src_prefix("capnp")
        .file("capnp/pcp.capnp")
        .default_parent_module(vec!["wire".into()])
        .run();
    if let Err(err) = result {
        // build scripts report through stderr; cargo shows it on failure
        eprintln!("error: compiling capnp/pcp.capnp (is Debian's `capnproto` installed?): {err}");
        std::process::exit(1);
    }
}
