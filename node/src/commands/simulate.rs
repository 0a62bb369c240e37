//! `pcp-node simulate`: pcp with thousands of volunteers, simulated in one
//! process (the `pcp-simulations` crate). A `.mlir` model is measured from its
//! IR: its parameter tensors, the tokens of one batch, and the FLOPs of the
//! fused training step pcp would compile for it. `--faults` runs the fault
//! simulator of shepherd failover instead: one seeded schedule, its report on
//! stdout, and exit code 1 with the broken invariant named. `--calibrate`
//! measures the shepherd's CPU costs on this machine and writes the table the
//! simulator reads (`--calibration FILE`, or stdout).

use anyhow::Context as _;
use pcp_simulations::{ModelSpec, SimulateArgs};

use crate::Failure;
use crate::training::model::Model;

/// Runs the simulation `args` describe and prints its table to stdout.
pub(crate) fn run(args: &SimulateArgs) -> Result<(), Failure> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.faults {
        return pcp_simulations::run_faults(args, &mut out).map(|_| ()).map_err(Failure::from);
    }
    if args.calibrate {
        return pcp_simulations::calibrate(args, &mut out).map(|_| ()).map_err(Failure::from);
    }
    let result = if args.model.ends_with(".mlir") {
        let spec = spec_of(&args.model).map_err(Failure::input)?;
        pcp_simulations::run_with_model(args, &spec, &mut out)
    } else {
        pcp_simulations::run(args, &mut out)
    };
    match result {
        Ok(_) => Ok(()),
        Err(e @ pcp_simulations::Error::Invalid(_)) => Err(Failure::input(e)),
        Err(e) => Err(e.into()),
    }
}

/// The simulator's view of the StableHLO loss at `path`.
fn spec_of(path: &str) -> anyhow::Result<ModelSpec> {
    let model = Model::load(path, 0)?;
    let (batch, block) = model.batch_block()?;
    let step = pcp_graph::train_step(&model.module, "main", &pcp_graph::StepConfig::default())
        .with_context(|| format!("{path}: building the training step"))?;
    let flops = pcp_graph::cost::flops(&step.module, "train_step")
        .with_context(|| format!("{path}: the training module has no @train_step"))?;
    Ok(ModelSpec {
        name: path.to_owned(),
        tensor_sizes: model.params.iter().map(|p| p.ty.elements().max(0) as u64).collect(),
        tokens_per_step: (batch * block) as u64,
        flops_per_step: flops,
    })
}
