//! Importing StableHLO: IREE normalises the text to generic form, melior
//! parses it with unregistered dialects allowed, and we read it into [`ir`].
//!
//! [`ir`]: crate::ir

use std::collections::HashMap;
use std::path::Path;

use melior::Context;
use melior::dialect::DialectRegistry;
use melior::ir::block::BlockLike;
use melior::ir::operation::{OperationLike, OperationPrintingFlags, OperationRef};
use melior::ir::{Module as MlirModule, RegionLike, ValueLike};
use melior::utility::register_all_dialects;

use crate::ir::attr::{matching_close, parse_dict};
use crate::ir::{Function, Module, Op, TensorType, TypeError, ValueId};
use crate::iree;

/// Why a model could not be imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The text is not valid MLIR.
    #[error("{path} does not parse: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The first diagnostic.
        message: String,
    },
    /// Something valid that pcp does not handle.
    #[error("{path}: {what}")]
    Unsupported {
        /// The file.
        path: String,
        /// What is unsupported.
        what: String,
    },
    /// A tensor type pcp cannot use, such as a dynamic shape.
    #[error("{path}: in @{function}: {error}")]
    Type {
        /// The file.
        path: String,
        /// The function.
        function: String,
        /// The type problem.
        error: TypeError,
    },
}

/// Reads and imports the module at `path`.
pub fn import_file(path: &Path) -> Result<Module, ImportError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ImportError::Read { path: name.clone(), source })?;
    import_text(&name, &text, Some(path))
}

/// Imports MLIR `text`; `name` labels errors.
pub fn import_str(name: &str, text: &str) -> Result<Module, ImportError> {
    import_text(name, text, None)
}

fn import_text(name: &str, text: &str, path: Option<&Path>) -> Result<Module, ImportError> {
    let generic = match iree::normalize(text, path) {
        Ok(generic) => generic,
        Err(iree::NormalizeError::Parse(message)) => {
            return Err(ImportError::Parse { path: name.to_owned(), message });
        }
        // Without IREE, generic-form input still imports; anything else
        // fails to parse below with melior's diagnostic.
        Err(iree::NormalizeError::Unavailable(reason)) => {
            tracing::debug!(%reason, "IREE compiler unavailable; parsing input as generic form");
            text.to_owned()
        }
    };
    parse_generic(name, &generic)
}

/// Checks that melior parses and verifies `module` as printed; `name` labels errors.
pub fn verify(name: &str, module: &Module) -> Result<(), ImportError> {
    with_parsed(name, &module.to_mlir(), |_| Ok(()))
}

/// A melior context that accepts StableHLO as unregistered ops.
pub(crate) fn context() -> Context {
    let registry = DialectRegistry::new();
    register_all_dialects(&registry);
    let context = Context::new_with_registry(&registry, false);
    context.load_all_available_dialects();
    context.set_allow_unregistered_dialects(true);
    context
}

/// Parses `text` with melior, returning the first diagnostic on failure.
pub(crate) fn with_parsed<T>(
    name: &str,
    text: &str,
    f: impl FnOnce(&MlirModule) -> Result<T, ImportError>,
) -> Result<T, ImportError> {
    let context = context();
    let diagnostics = std::rc::Rc::new(std::cell::RefCell::new(Vec::<String>::new()));
    let sink = diagnostics.clone();
    let id = context.attach_diagnostic_handler(move |d| {
        let message = d.to_string().replace('\n', "; ");
        sink.borrow_mut().push(format!("{}: {message}", crate::ir::human_location(&d.location().to_string())));
        true
    });
    let module = MlirModule::parse(&context, text);
    let result = match module {
        Some(module) if module.as_operation().verify() => f(&module),
        _ => {
            let message = diagnostics.borrow().first().cloned().unwrap_or_else(|| "invalid MLIR".to_owned());
            Err(ImportError::Parse { path: name.to_owned(), message })
        }
    };
    context.detach_diagnostic_handler(id);
    result
}

fn parse_generic(name: &str, text: &str) -> Result<Module, ImportError> {
    let resources = text.find("{-#").map(|i| text[i..].trim_end().to_owned());
    with_parsed(name, text, |module| {
        let mut functions = Vec::new();
        let mut next = module.body().first_operation();
        while let Some(op) = next {
            next = op.next_in_block();
            if op.name().as_string_ref().as_str().ok() == Some("func.func") {
                functions.push(read_function(name, op)?);
            }
        }
        Ok(Module { functions, resources: resources.clone() })
    })
}

fn string_attr(op: OperationRef<'_, '_>, key: &str) -> Option<String> {
    let text = op.attribute(key).ok()?.to_string();
    Some(text.trim_matches('"').to_owned())
}

fn read_function(path: &str, func: OperationRef<'_, '_>) -> Result<Function, ImportError> {
    let fname = string_attr(func, "sym_name").unwrap_or_default();
    let public = string_attr(func, "sym_visibility").is_none_or(|v| v == "public");
    let type_error = |error| ImportError::Type { path: path.to_owned(), function: fname.clone(), error };
    let unsupported = |what: String| ImportError::Unsupported { path: path.to_owned(), what };
    let region = func.region(0).map_err(|_| unsupported(format!("@{fname} has no body")))?;
    let block = region.first_block().ok_or_else(|| unsupported(format!("@{fname} is only a declaration")))?;
    if block.next_in_region().is_some() {
        return Err(unsupported(format!("@{fname} has several blocks; control flow is not supported")));
    }

    let mut arg_types = Vec::new();
    for i in 0..block.argument_count() {
        let arg = block.argument(i).map_err(|e| unsupported(e.to_string()))?;
        arg_types.push(TensorType::parse(&arg.r#type().to_string()).map_err(type_error)?);
    }
    let mut f = Function::new(fname.clone(), &arg_types);
    f.public = public;
    let mut values: HashMap<usize, ValueId> = HashMap::new();
    for (i, arg) in f.args.iter().enumerate() {
        let raw = block.argument(i).map_err(|e| unsupported(e.to_string()))?.to_raw().ptr as usize;
        values.insert(raw, *arg);
    }

    let flags = || OperationPrintingFlags::new().print_generic_operation_form().use_local_scope();
    let mut next = block.first_operation();
    while let Some(op) = next {
        next = op.next_in_block();
        let name = op.name().as_string_ref().as_str().unwrap_or_default().to_owned();
        let loc = Some(op.location().to_string());
        let mut operands = Vec::new();
        for operand in op.operands() {
            let id = values.get(&(operand.to_raw().ptr as usize)).copied().ok_or_else(|| {
                unsupported(format!(
                    "{name} at {} uses a value from outside @{fname}",
                    crate::ir::human_location(loc.as_deref().unwrap_or(""))
                ))
            })?;
            operands.push(id);
        }
        if name == "func.return" {
            f.results = operands;
            continue;
        }
        let mut results = Vec::new();
        for result in op.results() {
            let ty = TensorType::parse(&result.r#type().to_string()).map_err(type_error)?;
            let id = f.new_value(ty);
            values.insert(result.to_raw().ptr as usize, id);
            results.push(id);
        }
        let printed = op.to_string_with_flags(flags()).map_err(|e| unsupported(e.to_string()))?;
        let (props, regions, attrs) = split_printed(&printed);
        f.ops.push(Op { name, operands, results, props, attrs, regions, loc });
    }
    Ok(f)
}

/// The attribute pairs of an op's `<{…}>` or `{…}` dictionary.
type Pairs = Vec<(String, String)>;

/// Splits a generic op's printed text into its properties, regions and
/// discardable attributes.
fn split_printed(text: &str) -> (Pairs, Option<String>, Pairs) {
    // `%r = "name"(%a, %b) <{…}> ({…}) {…} : (…) -> …`
    let after_name = text.find("\"(").map_or(text.len(), |i| i + 1);
    let mut rest = matching_close(text, after_name).map_or("", |end| &text[end..]).trim_start();
    let mut props = Vec::new();
    let mut regions = None;
    let mut attrs = Vec::new();
    if let Some(end) = rest.starts_with("<{").then(|| matching_close(rest, 1)).flatten() {
        props = parse_dict(&rest[2..end - 1]);
        rest = rest[end..].trim_start_matches('>').trim_start();
    }
    if let Some(end) = rest.starts_with('(').then(|| matching_close(rest, 0)).flatten() {
        regions = Some(rest[..end].to_owned());
        rest = rest[end..].trim_start();
    }
    if let Some(end) = rest.starts_with('{').then(|| matching_close(rest, 0)).flatten() {
        attrs = parse_dict(&rest[1..end - 1]);
    }
    (props, regions, attrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_props_regions_and_attrs() {
        let (p, r, a) = split_printed(
            "%0 = \"stablehlo.reduce\"(%1, %2) <{dimensions = array<i64: 1>}> ({\n^bb0(%a: tensor<f32>, %b: tensor<f32>):\n  \"stablehlo.return\"(%a) : (tensor<f32>) -> ()\n}) {mhlo.x = \"}\"} : (tensor<2x3xf32>, tensor<f32>) -> tensor<2xf32>",
        );
        assert_eq!(p, vec![("dimensions".to_owned(), "array<i64: 1>".to_owned())]);
        assert!(r.expect("region").starts_with("({"));
        assert_eq!(a, vec![("mhlo.x".to_owned(), "\"}\"".to_owned())]);
    }

    #[test]
    fn parses_generic_form_without_iree() {
        let text = r#""builtin.module"() ({
  "func.func"() <{function_type = (tensor<3xf32>) -> tensor<f32>, sym_name = "main"}> ({
  ^bb0(%arg0: tensor<3xf32>):
    %0 = "stablehlo.constant"() <{value = dense<0.0> : tensor<f32>}> : () -> tensor<f32>
    %1 = "stablehlo.reduce"(%arg0, %0) <{dimensions = array<i64: 0>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %2 = "stablehlo.add"(%a, %b) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%2) : (tensor<f32>) -> ()
    }) : (tensor<3xf32>, tensor<f32>) -> tensor<f32>
    "func.return"(%1) : (tensor<f32>) -> ()
  }) : () -> ()
}) : () -> ()"#;
        let m = parse_generic("t.mlir", text).expect("parses");
        let f = m.function("main").expect("main");
        assert_eq!(f.ops.len(), 2);
        assert_eq!(f.ops[1].body_ops(), vec!["stablehlo.add"]);
        assert_eq!(f.results.len(), 1);
        // Round trip through our printer and melior again.
        let again = parse_generic("t2.mlir", &m.to_mlir()).expect("reparses");
        assert_eq!(again.function("main").map(|f| f.ops.len()), Some(2));
    }

    #[test]
    fn reports_parse_errors_with_location() {
        let err = parse_generic("bad.mlir", "\"builtin.module\"() ({ %0 = }) : () -> ()").expect_err("must fail");
        let msg = err.to_string();
        assert!(msg.starts_with("bad.mlir does not parse:"), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }

    #[test]
    fn rejects_dynamic_shapes() {
        let text = r#""builtin.module"() ({
  "func.func"() <{function_type = (tensor<?xf32>) -> tensor<?xf32>, sym_name = "main"}> ({
  ^bb0(%arg0: tensor<?xf32>):
    "func.return"(%arg0) : (tensor<?xf32>) -> ()
  }) : () -> ()
}) : () -> ()"#;
        let err = parse_generic("d.mlir", text).expect_err("dynamic");
        assert!(err.to_string().contains("dynamic shape"), "{err}");
    }
}
