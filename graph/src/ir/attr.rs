//! Reading MLIR attribute text: dictionaries, arrays and StableHLO structs.
//!
//! StableHLO is not registered with our MLIR context, so its attributes are
//! opaque to melior. Their printed form is regular, and these helpers read it.

/// Splits `text` at `sep` characters that are not nested in brackets or strings.
pub fn split_top_level(text: &str, sep: u8) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => i = skip_string(bytes, i),
            b'(' | b'[' | b'{' | b'<' => depth += 1,
            b')' | b']' | b'}' => depth -= 1,
            b'>' if i == 0 || bytes[i - 1] != b'-' => depth -= 1,
            c if c == sep && depth == 0 => {
                parts.push(text[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    let last = text[start..].trim();
    if !last.is_empty() {
        parts.push(last);
    }
    parts
}

/// Index of the closing quote of the string that opens at `start`.
fn skip_string(bytes: &[u8], start: usize) -> usize {
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return i,
            _ => i += 1,
        }
    }
    bytes.len()
}

/// Index just past the bracket that closes the one at `open` (one of `([{`),
/// counting only that bracket kind and skipping strings.
pub fn matching_close(text: &str, open: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let (o, c) = match bytes.get(open)? {
        b'(' => (b'(', b')'),
        b'[' => (b'[', b']'),
        b'{' => (b'{', b'}'),
        _ => return None,
    };
    let mut depth = 0i32;
    let mut i = open;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => i = skip_string(bytes, i),
            b if b == o => depth += 1,
            b if b == c => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Parses `key = value, flag, …` into pairs; a unit attribute gets `unit`.
pub fn parse_dict(text: &str) -> Vec<(String, String)> {
    split_top_level(text, b',')
        .into_iter()
        .map(|entry| match entry.split_once('=') {
            Some((k, v)) => (k.trim().to_owned(), v.trim().to_owned()),
            None => (entry.trim().to_owned(), "unit".to_owned()),
        })
        .collect()
}

/// The fields of a struct attribute such as `#stablehlo.dot<a = [0], b = [1]>`.
pub fn struct_fields(text: &str) -> Vec<(String, String)> {
    let Some(open) = text.find('<') else {
        return Vec::new();
    };
    let inner = text[open + 1..].trim_end().strip_suffix('>').unwrap_or(&text[open + 1..]);
    parse_dict(inner)
}

/// Looks up `key` in parsed pairs.
pub fn lookup<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// Parses integer lists in the forms `array<i64: 1, 2>`, `array<i64>`, `[1, 2]`
/// and `dense<[1, 2]> : tensor<2xi64>`.
pub fn parse_ints(text: &str) -> Option<Vec<i64>> {
    let text = text.trim();
    let body = if let Some(rest) = text.strip_prefix("array<") {
        let rest = rest.strip_suffix('>')?;
        match rest.split_once(':') {
            Some((_, values)) => values,
            None => "",
        }
    } else if let Some(rest) = text.strip_prefix("dense<") {
        let end = rest.rfind("> :")?;
        rest[..end].trim_start_matches('[').trim_end_matches(']')
    } else {
        text.strip_prefix('[')?.strip_suffix(']')?
    };
    body.split(',').map(str::trim).filter(|s| !s.is_empty()).map(|s| s.parse().ok()).collect()
}

/// Parses an integer attribute such as `1 : i64` or `1`.
pub fn parse_int(text: &str) -> Option<i64> {
    text.split(':').next()?.trim().parse().ok()
}

/// Parses `dense<[[lo, hi], …]> : tensor<Nx2xi64>` (or a splat) into pairs.
pub fn parse_pairs(text: &str, rank: usize) -> Option<Vec<(i64, i64)>> {
    let rest = text.trim().strip_prefix("dense<")?;
    let end = rest.rfind("> :")?;
    let body = &rest[..end];
    if !body.contains('[') {
        let v: i64 = body.trim().parse().ok()?;
        return Some(vec![(v, v); rank]);
    }
    let flat: Vec<i64> = body
        .split(['[', ']', ','])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().ok())
        .collect::<Option<_>>()?;
    (flat.len() == 2 * rank).then(|| flat.chunks(2).map(|c| (c[0], c[1])).collect())
}

/// Formats an `array<i64: …>` attribute.
pub fn i64_array(values: &[i64]) -> String {
    if values.is_empty() {
        return "array<i64>".to_owned();
    }
    let list: Vec<String> = values.iter().map(i64::to_string).collect();
    format!("array<i64: {}>", list.join(", "))
}

/// Formats a `[a, b]` list.
pub fn int_list(values: &[i64]) -> String {
    let list: Vec<String> = values.iter().map(i64::to_string).collect();
    format!("[{}]", list.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_nested_dicts() {
        let d = parse_dict(
            "dimension_numbers = #stablehlo.gather<offset_dims = [2], collapsed_slice_dims = [0]>, indices_are_sorted = false, slice_sizes = array<i64: 1, 64>",
        );
        assert_eq!(d.len(), 3);
        assert_eq!(lookup(&d, "slice_sizes").and_then(parse_ints), Some(vec![1, 64]));
        let fields = struct_fields(lookup(&d, "dimension_numbers").expect("dn"));
        assert_eq!(lookup(&fields, "offset_dims").and_then(parse_ints), Some(vec![2]));
    }

    #[test]
    fn arrows_do_not_close_brackets() {
        let parts = split_top_level("function_type = (tensor<f32>) -> tensor<f32>, sym_name = \"a,b\"", b',');
        assert_eq!(parts.len(), 2);
    }

    #[test]
    fn reads_int_forms() {
        assert_eq!(parse_ints("array<i64>"), Some(vec![]));
        assert_eq!(parse_ints("dense<[1, 2]> : tensor<2xi64>"), Some(vec![1, 2]));
        assert_eq!(parse_int("3 : i64"), Some(3));
        assert_eq!(parse_pairs("dense<[[0, 0], [3, -1]]> : tensor<2x2xi64>", 2), Some(vec![(0, 0), (3, -1)]));
        assert_eq!(parse_pairs("dense<0> : tensor<2x2xi64>", 2), Some(vec![(0, 0), (0, 0)]));
        assert_eq!(i64_array(&[1, 2]), "array<i64: 1, 2>");
    }

    #[test]
    fn matches_brackets_across_strings() {
        let s = "({ \"}\" })rest";
        assert_eq!(matching_close(s, 0), Some(9));
    }
}
