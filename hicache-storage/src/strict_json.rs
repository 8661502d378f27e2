//! Strict JSON for configuration documents: a key given twice in one object is an error.
//!
//! `serde_json` keeps the last of two equal keys without a word, so `{"dir": "/a", "dir": "/b"}`
//! would silently mean `/b`. A configuration that says two things about one field is refused
//! instead, naming the key and the object path it is in.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Parses `text` as one JSON value, refusing duplicate keys in any object (nested ones too).
/// The error text says which key, under which path (`$`, `$.plugin_config`, `$.nodes[2]`).
pub fn parse_strict(text: &str) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let v = Strict { path: "$".into() }.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// A value being read at `path`.
struct Strict {
    path: String,
}

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Strict {
            path: format!("{}[{}]", self.path, out.len()),
        })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!(
                    "key {:?} appears twice in the object at {}",
                    crate::error::cut(&key),
                    self.path
                )));
            }
            let v = map.next_value_seed(Strict {
                path: format!("{}.{}", self.path, crate::error::cut(&key)),
            })?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        let e = parse_strict(r#"{"dir": "/a", "dir": "/b"}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("\"dir\" appears twice in the object at $"),
            "{e}"
        );
        let e = parse_strict(r#"{"a": [1, {"x": 1, "x": 2}]}"#).unwrap_err();
        assert!(e.to_string().contains("at $.a[1]"), "{e}");
    }

    #[test]
    fn equal_to_serde_json_without_duplicates() {
        let text = r#"{"a": 1, "b": -2, "c": 1.5, "d": "s", "e": [true, null], "f": {"g": {}}}"#;
        assert_eq!(
            parse_strict(text).unwrap(),
            serde_json::from_str::<Value>(text).unwrap()
        );
        assert!(parse_strict("{} trailing").is_err());
        assert!(parse_strict("{").is_err());
    }
}
