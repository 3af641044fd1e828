//! The `tojson` filter as Hugging Face chat templates expect it.
//!
//! transformers replaces Jinja's `tojson` with Python's `json.dumps(x,
//! ensure_ascii=False, indent=…, separators=…, sort_keys=…)`: no HTML escaping,
//! `", "` and `": "` separators (`","` between items when indenting), keys in insertion
//! order. MiniJinja's built-in `tojson` escapes `<`, `>`, `&` and `'` for HTML, which
//! would change every tool schema a template prints, so this filter reproduces the
//! Python output instead. Cost: one pass over the value.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Formatting options of one `tojson` call.
struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// `value | tojson(indent=None, ensure_ascii=False, sort_keys=False, separators=None)`.
pub(crate) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v)?.min(64))),
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson separators must be a pair of strings",
            ));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let style = Style {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_value(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::String => write_str(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), items.len(), style, depth, |out, i| {
                write_value(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            write_container(out, ('{', '}'), keys.len(), style, depth, |out, i| {
                let key = &keys[i];
                match key.as_str() {
                    Some(s) => write_str(out, s, style),
                    None => write_str(out, &key.to_string(), style),
                }
                out.push_str(&style.key_sep);
                write_value(out, &value.get_item(key)?, style, depth + 1)
            })?;
        }
        // Numbers and booleans: serde's JSON text equals Python's for the values
        // templates print (integers, short floats, true/false).
        _ => out.push_str(&serde_json::to_string(value).map_err(|e| {
            Error::new(ErrorKind::InvalidOperation, "cannot serialize to json").with_source(e)
        })?),
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    (open, close): (char, char),
    len: usize,
    style: &Style,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(indent) = &style.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        item(out, i)?;
    }
    if let Some(indent) = &style.indent {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// A JSON string as Python writes it: serde's escapes (`\"`, `\\`, `\n`, `\r`, `\t`,
/// `\b`, `\f`, `\u00XX` for other control characters) are Python's; with
/// `ensure_ascii`, every non-ASCII character becomes `\uXXXX` (surrogate pairs above
/// the BMP).
fn write_str(out: &mut String, s: &str, style: &Style) {
    // Serializing a str to JSON cannot fail.
    let quoted = serde_json::to_string(s).unwrap_or_default();
    if !style.ensure_ascii {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use minijinja::{Environment, context};

    fn render(source: &str, value: serde_json::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", super::tojson);
        env.render_str(source, context! { v => minijinja::value::Serde(value) })
            .unwrap()
    }

    /// Expected strings are what CPython's `json.dumps` prints for the same calls.
    #[test]
    fn matches_python_json_dumps() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"name": "f<x>", "args": [1, 2.5, true, null], "e": {}}"#)
                .unwrap();
        let flat = render("{{ v | tojson }}", v.clone());
        // serde_json's map is ordered by key here; insertion order is kept for values
        // that come in as template values (see the crate tests).
        assert_eq!(
            flat,
            r#"{"args": [1, 2.5, true, null], "e": {}, "name": "f<x>"}"#
        );
        let indented = render("{{ v | tojson(indent=2) }}", v.clone());
        assert_eq!(
            indented,
            "{\n  \"args\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"e\": {},\n  \"name\": \"f<x>\"\n}"
        );
        let ascii = render(
            "{{ v | tojson(ensure_ascii=true) }}",
            serde_json::json!("é🚀"),
        );
        assert_eq!(ascii, r#""\u00e9\ud83d\ude80""#);
        let compact = render(
            "{{ v | tojson(separators=[',', ':']) }}",
            serde_json::json!([1, {"a": "b"}]),
        );
        assert_eq!(compact, r#"[1,{"a":"b"}]"#);
    }
}
