//! Einsum's notation, numpy's: the operands' terms separated by commas, a letter per dim, `...`
//! for the dims an operand has beyond its letters (broadcast across the operands, aligned on
//! the right); then `->` and the output's term, or, without it, the ellipsis's dims followed by
//! the letters that appear once, in alphabetical order. `graph::einsum` writes an equation out
//! as ops when the graph is bound.

/// One term of an equation: its letters in order, and where among them the ellipsis stands.
#[derive(Clone, Debug, PartialEq)]
pub struct Term {
    pub letters: Vec<u8>,
    pub ellipsis: Option<usize>,
}

impl Term {
    fn parse(s: &str) -> std::result::Result<Term, String> {
        let (mut letters, mut ellipsis, mut rest) = (Vec::new(), None, s);
        while let Some(c) = rest.chars().next() {
            if let Some(after) = rest.strip_prefix("...") {
                if ellipsis.replace(letters.len()).is_some() {
                    return Err(format!("term '{s}' has two ellipses"));
                }
                rest = after;
            } else if c.is_ascii_alphabetic() {
                letters.push(c as u8);
                rest = &rest[1..];
            } else {
                return Err(format!("term '{s}' has '{c}', which is neither a letter nor part of '...'"));
            }
        }
        Ok(Term { letters, ellipsis })
    }

    /// The labels of the term's dims, its ellipsis covering the last `covered` of the
    /// broadcast ellipsis's `rank` dims.
    pub fn labels(&self, covered: usize, rank: usize) -> Vec<Label> {
        let at = self.ellipsis.unwrap_or(self.letters.len());
        let letter = |c: &u8| *c as Label;
        let dots = (rank - covered..rank).map(|j| ELLIPSIS + j as Label);
        self.letters[..at].iter().map(letter).chain(dots).chain(self.letters[at..].iter().map(letter)).collect()
    }
}

impl std::fmt::Display for Term {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let at = self.ellipsis.unwrap_or(self.letters.len());
        let text = |s: &[u8]| String::from_utf8_lossy(s).into_owned();
        let dots = if self.ellipsis.is_some() { "..." } else { "" };
        write!(f, "{}{dots}{}", text(&self.letters[..at]), text(&self.letters[at..]))
    }
}

/// An equation's terms, checked for what does not depend on the operands' shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Equation {
    pub inputs: Vec<Term>,
    /// None: implicit (no `->`).
    pub output: Option<Term>,
}

impl Equation {
    /// Reads an equation (spaces are ignored); Err says what is wrong with it.
    pub fn parse(equation: &str) -> std::result::Result<Equation, String> {
        let s: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
        let (lhs, rhs) = match s.split_once("->") {
            Some((lhs, rhs)) => (lhs, Some(rhs)),
            None => (&s[..], None),
        };
        let inputs = lhs.split(',').map(Term::parse).collect::<std::result::Result<Vec<_>, _>>()?;
        let output = rhs.map(Term::parse).transpose()?;
        for (k, &c) in output.iter().flat_map(|t| t.letters.iter()).enumerate() {
            if output.as_ref().is_some_and(|t| t.letters[..k].contains(&c)) {
                return Err(format!("the output names '{}' twice", c as char));
            }
            if !inputs.iter().any(|t| t.letters.contains(&c)) {
                return Err(format!("the output's '{}' names no operand's dim", c as char));
            }
        }
        Ok(Equation { inputs, output })
    }
}

/// A dim's name: a letter (its ASCII code), or dim j of the ellipsis broadcast over the
/// operands (ELLIPSIS + j).
pub type Label = u32;
pub const ELLIPSIS: Label = 256;

pub fn show(l: Label) -> String {
    if l < ELLIPSIS {
        format!("'{}'", l as u8 as char)
    } else {
        format!("the ellipsis's dim {}", l - ELLIPSIS)
    }
}
