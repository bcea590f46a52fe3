//! Label selectors (the full `labels.Parse` grammar: `=`, `==`, `!=`, `in`, `notin`,
//! existence, `!` non-existence, `>`/`<`) and field selectors (`=`, `==`, `!=` on
//! `metadata.name`, `metadata.namespace` and per-resource extra fields).

use serde_json::Value;

use super::{registry::ResourceDef, status::ApiError};

#[derive(Clone, Debug, PartialEq)]
enum Op {
    Equals(String),
    NotEquals(String),
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    DoesNotExist,
    GreaterThan(i64),
    LessThan(i64),
}

#[derive(Clone, Debug, PartialEq)]
struct Requirement {
    key: String,
    op: Op,
}

impl Requirement {
    fn matches(&self, labels: Option<&serde_json::Map<String, Value>>) -> bool {
        let value = labels.and_then(|l| l.get(&self.key)).and_then(Value::as_str);
        match (&self.op, value) {
            (Op::Equals(want), Some(v)) => v == want,
            (Op::Equals(_), None) => false,
            // `!=` and `notin` also select objects without the label, as in Kubernetes.
            (Op::NotEquals(want), v) => v != Some(want.as_str()),
            (Op::In(set), Some(v)) => set.iter().any(|s| s == v),
            (Op::In(_), None) => false,
            (Op::NotIn(set), v) => v.is_none_or(|v| !set.iter().any(|s| s == v)),
            (Op::Exists, v) => v.is_some(),
            (Op::DoesNotExist, v) => v.is_none(),
            (Op::GreaterThan(n), Some(v)) => v.parse::<i64>().is_ok_and(|v| v > *n),
            (Op::LessThan(n), Some(v)) => v.parse::<i64>().is_ok_and(|v| v < *n),
            (Op::GreaterThan(_) | Op::LessThan(_), None) => false,
        }
    }
}

/// A parsed label selector; the empty selector selects everything.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    Comma,
    Open,
    Close,
    Eq,
    DoubleEq,
    NotEq,
    Not,
    Gt,
    Lt,
}

fn tokenize(text: &str) -> Result<Vec<Token>, String> {
    let mut tokens = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            ' ' | '\t' | '\n' => {
                chars.next();
            }
            ',' => {
                chars.next();
                tokens.push(Token::Comma);
            }
            '(' => {
                chars.next();
                tokens.push(Token::Open);
            }
            ')' => {
                chars.next();
                tokens.push(Token::Close);
            }
            '>' => {
                chars.next();
                tokens.push(Token::Gt);
            }
            '<' => {
                chars.next();
                tokens.push(Token::Lt);
            }
            '=' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    tokens.push(Token::DoubleEq);
                } else {
                    tokens.push(Token::Eq);
                }
            }
            '!' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    tokens.push(Token::NotEq);
                } else {
                    tokens.push(Token::Not);
                }
            }
            _ => {
                let mut ident = String::new();
                while let Some(&c) = chars.peek() {
                    if " \t\n,()=!<>".contains(c) {
                        break;
                    }
                    ident.push(c);
                    chars.next();
                }
                tokens.push(Token::Ident(ident));
            }
        }
    }
    Ok(tokens)
}

fn valid_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-.".contains(c))
    });
    name_ok && prefix_ok
}

fn valid_value(value: &str) -> bool {
    value.is_empty()
        || (value.len() <= 63
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && value.starts_with(|c: char| c.is_ascii_alphanumeric())
            && value.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos)
    }

    fn next(&mut self) -> Option<Token> {
        let token = self.tokens.get(self.pos).cloned();
        self.pos += 1;
        token
    }

    fn key(&mut self) -> Result<String, String> {
        match self.next() {
            Some(Token::Ident(key)) if valid_key(&key) => Ok(key),
            Some(Token::Ident(key)) => Err(format!("invalid label key \"{key}\"")),
            other => Err(format!("found '{other:?}', expected: identifier")),
        }
    }

    fn value(&mut self) -> Result<String, String> {
        // An empty value (`key=` followed by `,` or the end) is valid.
        match self.peek() {
            None | Some(Token::Comma) | Some(Token::Close) => return Ok(String::new()),
            _ => {}
        }
        match self.next() {
            Some(Token::Ident(value)) if valid_value(&value) => Ok(value),
            Some(Token::Ident(value)) => Err(format!("invalid label value: \"{value}\"")),
            other => Err(format!("found '{other:?}', expected: identifier")),
        }
    }

    fn set(&mut self) -> Result<Vec<String>, String> {
        if self.next() != Some(Token::Open) {
            return Err("found no '(', expected: '('".into());
        }
        let mut values = Vec::new();
        loop {
            values.push(self.value()?);
            match self.next() {
                Some(Token::Comma) => continue,
                Some(Token::Close) => return Ok(values),
                other => return Err(format!("found '{other:?}', expected: ',' or ')'")),
            }
        }
    }

    fn integer(&mut self) -> Result<i64, String> {
        match self.next() {
            Some(Token::Ident(value)) => value
                .parse()
                .map_err(|_| format!("for 'Gt', 'Lt' operators, the value must be an integer: {value}")),
            other => Err(format!("found '{other:?}', expected: integer")),
        }
    }

    fn requirement(&mut self) -> Result<Requirement, String> {
        if self.peek() == Some(&Token::Not) {
            self.next();
            let key = self.key()?;
            return Ok(Requirement {
                key,
                op: Op::DoesNotExist,
            });
        }
        let key = self.key()?;
        let op = match self.peek() {
            None | Some(Token::Comma) => Op::Exists,
            Some(Token::Eq | Token::DoubleEq) => {
                self.next();
                Op::Equals(self.value()?)
            }
            Some(Token::NotEq) => {
                self.next();
                Op::NotEquals(self.value()?)
            }
            Some(Token::Gt) => {
                self.next();
                Op::GreaterThan(self.integer()?)
            }
            Some(Token::Lt) => {
                self.next();
                Op::LessThan(self.integer()?)
            }
            Some(Token::Ident(word)) if word == "in" => {
                self.next();
                Op::In(self.set()?)
            }
            Some(Token::Ident(word)) if word == "notin" => {
                self.next();
                Op::NotIn(self.set()?)
            }
            Some(other) => {
                return Err(format!(
                    "found '{other:?}', expected: in, notin, =, ==, !=, gt, lt"
                ));
            }
        };
        Ok(Requirement { key, op })
    }
}

impl LabelSelector {
    /// Parses `labelSelector`; errors read like the API server's 400 messages.
    pub fn parse(text: &str) -> Result<Self, ApiError> {
        let fail = |why: String| ApiError::bad_request(format!("unable to parse requirement: {why}"));
        let tokens = tokenize(text).map_err(fail)?;
        let mut parser = Parser { tokens, pos: 0 };
        let mut requirements = Vec::new();
        if parser.peek().is_none() {
            return Ok(Self::default());
        }
        loop {
            requirements.push(parser.requirement().map_err(fail)?);
            match parser.next() {
                None => break,
                Some(Token::Comma) => continue,
                Some(other) => return Err(fail(format!("found '{other:?}', expected: ','"))),
            }
        }
        Ok(Self { requirements })
    }

    /// Whether `object`'s `metadata.labels` satisfy every requirement.
    pub fn matches(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels").and_then(Value::as_object);
        self.requirements.iter().all(|r| r.matches(labels))
    }

    /// Selects everything.
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }
}

/// A parsed field selector.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FieldSelector {
    terms: Vec<(String, bool, String)>,
}

impl FieldSelector {
    /// Parses `fieldSelector` for `def`; unknown fields are a 400, as in Kubernetes.
    pub fn parse(text: &str, def: &ResourceDef) -> Result<Self, ApiError> {
        let mut terms = Vec::new();
        for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, true, v)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{text}'; can't understand '{term}'"
                )));
            };
            let field = field.trim();
            let known = field == "metadata.name"
                || field == "metadata.namespace"
                || def.extra_field_selectors.iter().any(|f| f == field);
            if !known {
                return Err(ApiError::bad_request(format!(
                    "field label not supported: {field}"
                )));
            }
            terms.push((field.to_owned(), equal, value.trim().to_owned()));
        }
        Ok(Self { terms })
    }

    /// Whether `object` satisfies every term (a missing field reads as the empty string).
    pub fn matches(&self, object: &Value) -> bool {
        self.terms.iter().all(|(field, equal, want)| {
            let mut node = object;
            for part in field.split('.') {
                node = node.get(part).unwrap_or(&Value::Null);
            }
            let actual = match node {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            (actual == *want) == *equal
        })
    }

    /// Selects everything.
    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }
}
