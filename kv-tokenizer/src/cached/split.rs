//! Where a text can be cut so that its pieces tokenize to exactly the ids of the
//! whole: right after an added token (`<|im_end|>`, a BOS written into the text).
//!
//! Why this is exact: Hugging Face tokenizers first split the text on the added
//! tokens that match the raw text (`normalized: false`), scanning for the
//! leftmost-longest match and going on after each match's end, and only then
//! normalize, pre-tokenize and run the model on each piece between them, piece by
//! piece. So, after a match that ends at byte `k`, the rest of the text is split,
//! normalized and encoded the same whatever came before `k` — with one exception:
//! steps that look at whether a piece starts the text (Metaspace's
//! `prepend_scheme: first`). [`Splitter`] therefore encodes the piece after `k`
//! behind the same added token (the *sentinel*) and drops the sentinel's id, so the
//! piece is never at the start of its own text either.
//!
//! The cut is refused where it would not be exact: a token with `rstrip` (its match
//! swallows the spaces after it, which belong to the next piece), `single_word` (its
//! match depends on the next character), a tokenizer that encodes special tokens as
//! text, or two added tokens with the same content. The matches themselves are found
//! with the same rule as the tokenizer (`aho-corasick`, leftmost-longest), over the
//! same tokens.
//!
//! Cost: one automaton scan of the text, linear, a few GB/s.

use aho_corasick::{AhoCorasick, MatchKind};
use std::collections::HashSet;

/// The added token a cut follows: its id and content.
#[derive(Debug, Clone)]
pub(crate) struct Sentinel {
    pub(crate) id: u32,
    pub(crate) content: String,
}

/// A run of text ending at a cut (or at the text's end), after the cut before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece<'t> {
    /// The sentinel before the piece; `None` for the piece at the start of the text.
    pub(crate) after: Option<u32>,
    /// The piece's text, from just after the cut before it.
    pub(crate) text: &'t str,
    /// Whether the piece ends at a cut (an added token); the last piece of a text
    /// may not.
    pub(crate) closed: bool,
}

/// Finds the cuts of a text, for one tokenizer.
#[derive(Debug)]
pub(crate) struct Splitter {
    automaton: AhoCorasick,
    /// Per automaton pattern: the token, and whether a cut may follow it.
    patterns: Vec<(Sentinel, bool)>,
}

impl Splitter {
    /// The splitter for `tokenizer`, or why its text cannot be cut exactly.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer) -> Result<Self, String> {
        if tokenizer.get_encode_special_tokens() {
            return Err("the tokenizer encodes special tokens as text".into());
        }
        let mut added: Vec<_> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| !t.normalized)
            .collect();
        if added.is_empty() {
            return Err("the tokenizer has no added tokens to cut at".into());
        }
        added.sort_by_key(|(id, _)| *id);
        let mut contents = HashSet::new();
        let mut patterns = Vec::with_capacity(added.len());
        for (id, token) in added {
            if token.content.is_empty() || !contents.insert(token.content.clone()) {
                return Err(format!("added token {id} is empty or a duplicate"));
            }
            if token.single_word {
                // Its match depends on the characters around it; replicating that
                // check is not worth it for the rare tokenizers that use it.
                return Err(format!("added token {:?} is single_word", token.content));
            }
            let cut = !token.rstrip;
            let sentinel = Sentinel {
                id,
                content: token.content,
            };
            patterns.push((sentinel, cut));
        }
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(patterns.iter().map(|(s, _)| &s.content))
            .map_err(|e| format!("added tokens: {e}"))?;
        Ok(Self {
            automaton,
            patterns,
        })
    }

    /// The sentinel with `id`, if it is one a cut may follow.
    pub(crate) fn sentinel(&self, id: u32) -> Option<&Sentinel> {
        self.patterns
            .iter()
            .find(|(s, cut)| *cut && s.id == id)
            .map(|(s, _)| s)
    }

    /// The contents of up to four tokens a cut may follow, for probe texts.
    pub(crate) fn probe_tokens(&self) -> Vec<&str> {
        self.patterns
            .iter()
            .filter(|(_, cut)| *cut)
            .take(4)
            .map(|(s, _)| s.content.as_str())
            .collect()
    }

    /// Cuts `text` after every added token that allows it. The pieces cover the
    /// text in order; an empty text is one empty piece.
    pub(crate) fn pieces<'t>(&self, text: &'t str) -> Vec<Piece<'t>> {
        let mut pieces = Vec::new();
        let mut start = 0;
        let mut after = None;
        for m in self.automaton.find_iter(text) {
            let (sentinel, cut) = &self.patterns[m.pattern().as_usize()];
            if !cut {
                continue;
            }
            pieces.push(Piece {
                after,
                text: &text[start..m.end()],
                closed: true,
            });
            start = m.end();
            after = Some(sentinel.id);
        }
        if start < text.len() || pieces.is_empty() {
            pieces.push(Piece {
                after,
                text: &text[start..],
                closed: false,
            });
        }
        pieces
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::{AddedToken, Tokenizer};

    fn tokenizer(tokens: Vec<AddedToken>) -> Tokenizer {
        let vocab = [("[UNK]".to_string(), 0)].into_iter().collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .unwrap(); // a one-word vocabulary with its unknown token is valid
        let mut t = Tokenizer::new(model);
        t.add_special_tokens(tokens).unwrap(); // adding to a fresh vocabulary cannot fail
        t
    }

    fn special(content: &str) -> AddedToken {
        AddedToken::from(content, true)
    }

    #[test]
    fn cuts_after_each_added_token_and_keeps_the_tail() {
        let t = tokenizer(vec![special("<s>"), special("<e>")]);
        let s = Splitter::new(&t).unwrap();
        let pieces = s.pieces("<s>hi<e>you<s>x");
        let texts: Vec<_> = pieces.iter().map(|p| p.text).collect();
        assert_eq!(texts, ["<s>", "hi<e>", "you<s>", "x"]);
        let closed: Vec<_> = pieces.iter().map(|p| p.closed).collect();
        assert_eq!(closed, [true, true, true, false]);
        assert_eq!(pieces[0].after, None);
        assert_eq!(pieces[1].after, t.token_to_id("<s>"));
        assert_eq!(pieces[2].after, t.token_to_id("<e>"));
    }

    #[test]
    fn text_without_added_tokens_is_one_open_piece() {
        let t = tokenizer(vec![special("<s>")]);
        let s = Splitter::new(&t).unwrap();
        assert_eq!(
            s.pieces("plain"),
            [Piece {
                after: None,
                text: "plain",
                closed: false
            }]
        );
        assert_eq!(s.pieces("").len(), 1);
    }

    #[test]
    fn the_longest_token_wins_as_in_the_tokenizer() {
        let t = tokenizer(vec![special("<e>"), special("<e>\n")]);
        let s = Splitter::new(&t).unwrap();
        let texts: Vec<_> = s.pieces("a<e>\nb").iter().map(|p| p.text).collect();
        assert_eq!(texts, ["a<e>\n", "b"]);
    }

    #[test]
    fn no_cut_after_an_rstrip_token_and_none_for_single_word() {
        let t = tokenizer(vec![special("<s>"), special("<r>").rstrip(true)]);
        let s = Splitter::new(&t).unwrap();
        let texts: Vec<_> = s.pieces("a<r> b<s>c").iter().map(|p| p.text).collect();
        assert_eq!(texts, ["a<r> b<s>", "c"]);
        assert!(s.sentinel(t.token_to_id("<r>").unwrap()).is_none());

        let t = tokenizer(vec![special("<w>").single_word(true)]);
        assert!(Splitter::new(&t).is_err());
    }
}
