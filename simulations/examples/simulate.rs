//! `cargo run --release -p pcp-simulations --example simulate -- --nodes 10000 --rounds 100`:
//! the simulator without `pcp-node`.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Simulate pcp at planet scale")]
struct Cli {
    #[command(flatten)]
    args: pcp_simulations::SimulateArgs,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    if cli.args.calibrate {
        pcp_simulations::calibrate(&cli.args, &mut stdout.lock())?;
        return Ok(());
    }
    pcp_simulations::run(&cli.args, &mut stdout.lock())?;
    Ok(())
}
