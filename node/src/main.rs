//! `pcp-node`: the binary. Everything but the allocator is the `pcp_node` library
//! ([`pcp_node::commands`]).

/// Keeps the training step's large host blocks for the next step instead of
/// returning them to the kernel (see [`pcp_runtime::HostAllocator`]).
#[global_allocator]
static ALLOC: pcp_runtime::HostAllocator = pcp_runtime::HostAllocator::new();

fn main() -> std::process::ExitCode {
    pcp_node::main()
}
