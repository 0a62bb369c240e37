//! Loads VMFBs compiled by the venv's `iree-compile` and runs them on the CPU.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use pcp_runtime::{Arg, Device, HostTensor, InvokeError, LoadError, Session};

/// One SGD-like step on a quadratic: `w - 0.5 (w - x)` and the loss `sum((w - x)^2)`.
const STEP: &str = r#"
func.func @step(%w: tensor<4xf32>, %x: tensor<4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %lr = stablehlo.constant dense<0.5> : tensor<4xf32>
  %d = stablehlo.subtract %w, %x : tensor<4xf32>
  %g = stablehlo.multiply %d, %lr : tensor<4xf32>
  %nw = stablehlo.subtract %w, %g : tensor<4xf32>
  %sq = stablehlo.multiply %d, %d : tensor<4xf32>
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %loss = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0]
    : (tensor<4xf32>, tensor<f32>) -> tensor<f32>
  return %nw, %loss : tensor<4xf32>, tensor<f32>
}

func.func @count(%tokens: tensor<2x3xi64>, %n: tensor<i32>) -> (tensor<2x3xi64>, tensor<i32>) {
  %one = stablehlo.constant dense<1> : tensor<2x3xi64>
  %next = stablehlo.add %tokens, %one : tensor<2x3xi64>
  %m = stablehlo.add %n, %n : tensor<i32>
  return %next, %m : tensor<2x3xi64>, tensor<i32>
}
"#;

/// Compiles StableHLO text to a CPU VMFB with `iree-compile` from the
/// workspace's `.venv` (or `$IREE_COMPILE`).
fn compile(mlir: &str) -> Result<Vec<u8>> {
    compile_for(mlir, &["--iree-hal-target-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host"])
}

/// Compiles StableHLO text with `target` flags.
fn compile_for(mlir: &str, target: &[&str]) -> Result<Vec<u8>> {
    let compiler = std::env::var_os("IREE_COMPILE")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/iree-compile"), PathBuf::from);
    let dir = tempfile::tempdir()?;
    let input = dir.path().join("module.mlir");
    let output = dir.path().join("module.vmfb");
    std::fs::write(&input, mlir)?;
    let result = Command::new(&compiler)
        .arg("--iree-input-type=stablehlo")
        .args(target)
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .output()
        .with_context(|| format!("running {} (run scripts/setup.sh)", compiler.display()))?;
    ensure!(result.status.success(), "iree-compile failed: {}", String::from_utf8_lossy(&result.stderr));
    Ok(std::fs::read(&output)?)
}

async fn step_session() -> Result<Session> {
    Ok(Session::load(Device::Cpu, compile(STEP)?).await?)
}

fn f32s(shape: &[usize], data: &[f32]) -> HostTensor {
    HostTensor::f32(shape.to_vec(), data.to_vec()).expect("shape matches data")
}

/// The same step on the host, for reference.
fn host_step(w: &[f32], x: &[f32]) -> (Vec<f32>, f32) {
    let d: Vec<f32> = w.iter().zip(x).map(|(w, x)| w - x).collect();
    let next = w.iter().zip(&d).map(|(w, d)| w - d * 0.5).collect();
    (next, d.iter().map(|d| d * d).sum())
}

#[test]
fn handles_can_cross_tasks_and_threads() {
    fn shareable<T: Send + Sync + Clone + 'static>() {}
    shareable::<Session>();
    shareable::<pcp_runtime::Buffer>();
    shareable::<Arg>();
}

#[tokio::test]
async fn step_outputs_are_correct() -> Result<()> {
    let session = step_session().await?;
    let w = f32s(&[4], &[1.0, 2.0, 3.0, 4.0]);
    let x = f32s(&[4], &[0.0; 4]);
    let outputs = session.invoke("module.step", vec![w.into(), x.into()]).await?;
    assert_eq!(outputs.len(), 2);
    assert_eq!(outputs[0].shape(), [4]);
    assert!(outputs[1].shape().is_empty());
    let next = session.download(&outputs[0]).await?;
    assert_eq!(next.shape(), [4]);
    assert_eq!(next.into_f32()?, vec![0.5, 1.0, 1.5, 2.0]);
    assert_eq!(session.download(&outputs[1]).await?.into_f32()?, vec![30.0]);
    Ok(())
}

#[tokio::test]
async fn device_resident_state_matches_host_over_100_steps() -> Result<()> {
    let session = step_session().await?;
    let x_host = [0.25, -1.5, 3.0, 8.0];
    let mut w_host = vec![10.0, -20.0, 30.5, 0.125];
    // Parameters and the fixed input live on the device for the whole run.
    let mut w = session.upload(f32s(&[4], &w_host)).await?;
    let x = session.upload(f32s(&[4], &x_host)).await?;
    let mut losses = Vec::new();
    let mut host_losses = Vec::new();
    for _ in 0..100 {
        let mut outputs = session.invoke("module.step", vec![Arg::from(&w), Arg::from(&x)]).await?;
        let loss = outputs.pop().context("loss output")?;
        w = outputs.pop().context("parameter output")?;
        // Only the loss scalar comes back each step.
        losses.push(session.download(&loss).await?.into_f32()?[0]);
        let (next, host_loss) = host_step(&w_host, &x_host);
        w_host = next;
        host_losses.push(host_loss);
    }
    let w_device = session.download(&w).await?.into_f32()?;
    for (device, host) in w_device.iter().zip(&w_host) {
        assert!((device - host).abs() <= 1e-6 * host.abs().max(1.0), "{device} vs {host}");
    }
    for (device, host) in losses.iter().zip(&host_losses) {
        assert!((device - host).abs() <= 1e-5 * host.abs().max(1e-30), "{device} vs {host}");
    }
    assert!(losses[99] < 1e-20, "the step converges: {}", losses[99]);
    // Dropped outputs were freed: only the parameters and the input remain.
    let stats = session.stats().await?;
    assert_eq!(stats.buffers, 2);
    assert_eq!(stats.bytes, 2 * 4 * 4);
    drop((w, x));
    assert_eq!(session.stats().await?.buffers, 0);
    Ok(())
}

#[tokio::test]
async fn integer_tensors_round_trip() -> Result<()> {
    let session = step_session().await?;
    let tokens = HostTensor::i64(vec![2, 3], vec![0, 1, 2, 3, 4, 50_000_000_000])?;
    let n = HostTensor::i32(vec![], vec![21])?;
    let outputs = session.invoke("module.count", vec![tokens.into(), n.into()]).await?;
    let next = session.download(&outputs[0]).await?;
    assert_eq!(next.shape(), [2, 3]);
    assert_eq!(next.into_i64()?, vec![1, 2, 3, 4, 5, 50_000_000_001]);
    assert_eq!(session.download(&outputs[1]).await?.into_i32()?, vec![42]);
    let uploaded = session.upload(HostTensor::i32(vec![2], vec![-7, 9])?).await?;
    assert_eq!(session.download(&uploaded).await?.into_i32()?, vec![-7, 9]);
    Ok(())
}

/// rocm is in the build; without its vendor library (an override pointing nowhere,
/// so this holds on an AMD machine too) loading names the library, on one line.
#[tokio::test]
async fn missing_vendor_library_is_named() -> Result<()> {
    assert!(Device::Rocm.is_available(), "the HIP driver is built in");
    // SAFETY: only this test reads the variable.
    unsafe { std::env::set_var("PCP_HIP_LIBRARY", "/nonexistent/libamdhip64.so") };
    let error = Session::load(Device::Rocm, compile(STEP)?).await.expect_err("no HIP library");
    assert!(matches!(error, LoadError::Probe(_)), "{error:?}");
    assert_eq!(error.to_string(), "backend rocm: /nonexistent/libamdhip64.so not found (install ROCm 6.x)");
    Ok(())
}

/// The same step through IREE's Vulkan driver, on whatever Vulkan device there is
/// (Mesa's lavapipe, a Vulkan device on the CPU, where no GPU is: scripts/setup.sh
/// installs it), agrees with the host.
#[tokio::test]
async fn vulkan_runs_the_step_like_the_host() -> Result<()> {
    let found = pcp_runtime::probe(Device::Vulkan)?;
    ensure!(!found.is_empty(), "no Vulkan device");
    let session =
        Session::load(Device::Vulkan, compile_for(STEP, &["--iree-hal-target-backends=vulkan-spirv"])?).await?;
    let (w, x) = ([1.0, -2.0, 3.5, 4.0], [0.5, 0.25, -1.0, 2.0]);
    let outputs = session.invoke("module.step", vec![f32s(&[4], &w).into(), f32s(&[4], &x).into()]).await?;
    let next = session.download(&outputs[0]).await?.into_f32()?;
    let loss = session.download(&outputs[1]).await?.into_f32()?;
    let (want_next, want_loss) = host_step(&w, &x);
    assert_eq!(next, want_next);
    assert!((loss[0] - want_loss).abs() <= 1e-5 * want_loss.abs(), "{loss:?} vs {want_loss}");
    Ok(())
}

#[tokio::test]
async fn bad_vmfb_is_a_one_line_error() {
    for bytes in [Vec::new(), b"not a flatbuffer at all, just text".repeat(8)] {
        let error = Session::load(Device::Cpu, bytes).await.expect_err("garbage must not load");
        assert!(matches!(error, LoadError::Module { .. }), "{error:?}");
        let text = error.to_string();
        assert!(text.starts_with("invalid VMFB"), "{text}");
        assert!(!text.contains('\n'), "{text}");
    }
}

#[tokio::test]
async fn wrong_arity_names_the_function() -> Result<()> {
    let session = step_session().await?;
    let error =
        session.invoke("module.step", vec![f32s(&[4], &[0.0; 4]).into()]).await.expect_err("one argument short");
    assert!(matches!(error, InvokeError::Arity { expected: 2, actual: 1, .. }), "{error:?}");
    assert_eq!(error.to_string(), "`module.step` takes 2 arguments, got 1");
    Ok(())
}

#[tokio::test]
async fn wrong_shape_or_type_names_the_argument() -> Result<()> {
    let session = step_session().await?;
    let error = session
        .invoke("module.step", vec![f32s(&[4], &[0.0; 4]).into(), f32s(&[3], &[0.0; 3]).into()])
        .await
        .expect_err("argument 1 has the wrong shape");
    assert!(matches!(error, InvokeError::Argument { index: 1, .. }), "{error:?}");
    let text = error.to_string();
    assert!(text.starts_with("`module.step` argument 1: "), "{text}");
    assert!(text.contains("mismatch") && !text.contains('\n'), "{text}");

    let error = session
        .invoke("module.step", vec![HostTensor::i32(vec![4], vec![0; 4])?.into(), f32s(&[4], &[0.0; 4]).into()])
        .await
        .expect_err("argument 0 has the wrong element type");
    assert!(matches!(error, InvokeError::Argument { index: 0, .. }), "{error:?}");

    // The session survives bad calls.
    let outputs =
        session.invoke("module.step", vec![f32s(&[4], &[2.0; 4]).into(), f32s(&[4], &[0.0; 4]).into()]).await?;
    assert_eq!(session.download(&outputs[1]).await?.into_f32()?, vec![16.0]);
    Ok(())
}

#[tokio::test]
async fn unknown_function_is_named() -> Result<()> {
    let session = step_session().await?;
    let error = session.invoke("module.train_step", vec![]).await.expect_err("no such export");
    assert!(matches!(error, InvokeError::UnknownFunction { .. }), "{error:?}");
    let text = error.to_string();
    assert!(text.starts_with("no function `module.train_step`"), "{text}");
    assert!(!text.contains('\n'), "{text}");
    Ok(())
}

#[tokio::test]
async fn buffers_stay_in_their_session() -> Result<()> {
    let vmfb = compile(STEP)?;
    let first = Session::load(Device::Cpu, vmfb.clone()).await?;
    let second = Session::load(Device::Cpu, vmfb).await?;
    let w = first.upload(f32s(&[4], &[1.0; 4])).await?;
    let error = second
        .invoke("module.step", vec![Arg::from(&w), Arg::from(&w)])
        .await
        .expect_err("buffer from another session");
    assert!(matches!(error, InvokeError::ForeignBuffer { index: 0, .. }), "{error:?}");
    assert!(second.download(&w).await.is_err());
    // A clone of the handle drives the same thread and sees the same buffers.
    let again = first.clone();
    assert_eq!(again.download(&w).await?.into_f32()?, vec![1.0; 4]);
    Ok(())
}
