//! The built-in nanoGPT round-trips through IREE's parser, and is written out
//! for the JAX reference test (`tests/reference/test_nanogpt_builtin.py`).
//!
//! With `PCP_EMIT_DIR` set, the files land there; otherwise in a temporary
//! directory. For each configuration `NAME` it writes `NAME.mlir` (`@main`
//! and `@logits`), `NAME.json` (configuration, parameters and data inputs)
//! and, for the tiny configuration, `NAME_grad.mlir` (`differentiate` output).

use std::fmt::Write as _;
use std::path::Path;

use pcp_graph::models::{BuiltModel, Init, NanoGptConfig};
use pcp_graph::{differentiate, import_file, nanogpt};

fn shape_json(shape: &[i64]) -> String {
    format!("[{}]", shape.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))
}

fn describe(config: &NanoGptConfig, model: &BuiltModel) -> String {
    let mut out = String::from("{\n");
    let _ = writeln!(
        out,
        "  \"config\": {{\"n_layer\": {}, \"n_head\": {}, \"n_embd\": {}, \"block_size\": {}, \"vocab_size\": {}, \"batch_size\": {}, \"bias\": {}}},",
        config.n_layer,
        config.n_head,
        config.n_embd,
        config.block_size,
        config.vocab_size,
        config.batch_size,
        config.bias
    );
    let params: Vec<String> = model
        .params
        .iter()
        .map(|p| {
            let init = match p.init {
                Init::Normal { std } => format!("{{\"kind\": \"normal\", \"std\": {std:e}}}"),
                Init::Zeros => "{\"kind\": \"zeros\"}".to_owned(),
                Init::Ones => "{\"kind\": \"ones\"}".to_owned(),
            };
            format!("    {{\"name\": \"{}\", \"shape\": {}, \"init\": {init}}}", p.name, shape_json(&p.ty.shape))
        })
        .collect();
    let _ = writeln!(out, "  \"params\": [\n{}\n  ],", params.join(",\n"));
    let data: Vec<String> = model
        .data
        .iter()
        .map(|(name, ty)| {
            format!("    {{\"name\": \"{name}\", \"shape\": {}, \"dtype\": \"{}\"}}", shape_json(&ty.shape), ty.element)
        })
        .collect();
    let _ = writeln!(out, "  \"data\": [\n{}\n  ]\n}}", data.join(",\n"));
    out
}

fn emit(dir: &Path, name: &str, config: &NanoGptConfig, with_gradient: bool) -> anyhow::Result<()> {
    emit_with(dir, name, config, with_gradient, false)
}

/// [`emit`]; with `naive_too`, also `NAME_naive_grad.mlir`, the gradient with
/// attention as the model writes it (not fused).
fn emit_with(
    dir: &Path,
    name: &str,
    config: &NanoGptConfig,
    with_gradient: bool,
    naive_too: bool,
) -> anyhow::Result<()> {
    let model = nanogpt(config)?;
    let path = dir.join(format!("{name}.mlir"));
    std::fs::write(&path, model.module.to_mlir())?;
    std::fs::write(dir.join(format!("{name}.json")), describe(config, &model))?;

    // IREE's parser reads the emitted text back into the same signatures.
    let reread = import_file(&path)?;
    for f in &model.module.functions {
        let g = reread.function(&f.name).ok_or_else(|| anyhow::anyhow!("@{} lost on re-import", f.name))?;
        assert_eq!(g.arg_types(), f.arg_types(), "@{} arguments", f.name);
        assert_eq!(g.result_types(), f.result_types(), "@{} results", f.name);
        assert_eq!(g.ops.len(), f.ops.len(), "@{} op count", f.name);
    }

    if with_gradient {
        let gradient = differentiate(&model.module, "main")?;
        std::fs::write(dir.join(format!("{name}_grad.mlir")), gradient.module.to_mlir())?;
        let text = gradient.module.to_mlir();
        assert!(text.contains("stablehlo.concatenate") == (config.block_size > 256), "strips only past 256");
    }
    if naive_too {
        let naive = pcp_graph::autodiff::differentiate_with(&model.module, "main", pcp_graph::Attention::Naive)?;
        std::fs::write(dir.join(format!("{name}_naive_grad.mlir")), naive.module.to_mlir())?;
    }
    Ok(())
}

#[test]
fn emit_nanogpt() -> anyhow::Result<()> {
    let temp = tempfile::tempdir()?;
    let dir = std::env::var_os("PCP_EMIT_DIR").map_or_else(|| temp.path().to_path_buf(), Into::into);
    std::fs::create_dir_all(&dir)?;
    emit(&dir, "nanogpt_small", &NanoGptConfig::small(), false)?;
    let tiny =
        NanoGptConfig { n_layer: 2, n_head: 4, n_embd: 32, block_size: 8, vocab_size: 11, batch_size: 4, bias: true };
    emit(&dir, "nanogpt_tiny", &tiny, true)?;
    // attention at T = 1024: 8 strips of 128 rows, checked against the naive form
    let long = NanoGptConfig {
        n_layer: 1,
        n_head: 2,
        n_embd: 32,
        block_size: 1024,
        vocab_size: 11,
        batch_size: 2,
        bias: true,
    };
    emit_with(&dir, "nanogpt_long", &long, true, true)?;
    Ok(())
}
