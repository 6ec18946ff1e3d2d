//! The one error of profile validation: file, line, column and the problem.
//! Every section builds it the same way, from the span (byte range) of what
//! is wrong, through [`Ctx::err`].

/// A byte range of the profile text, as `toml::Spanned` gives it.
pub type Span = std::ops::Range<usize>;

#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}:{col}: {msg}")]
pub struct ProfileError {
    pub file: String,
    /// 1-based; 0 when the file could not be read at all.
    pub line: usize,
    pub col: usize,
    pub msg: String,
}

/// The profile being validated: its name (for messages) and its text (to
/// turn spans into lines and columns).
pub struct Ctx<'a> {
    pub file: &'a str,
    pub text: &'a str,
}

impl Ctx<'_> {
    /// The problem `msg` at the start of `span`.
    pub fn err(&self, span: Span, msg: impl Into<String>) -> ProfileError {
        let (line, col) = line_col_of(self.text, span.start);
        ProfileError { file: self.file.to_string(), line, col, msg: msg.into() }
    }

    /// The problem `msg` at column 1 of `line`, for checks about a whole
    /// table whose line is all the model keeps.
    pub fn err_at_line(&self, line: usize, msg: impl Into<String>) -> ProfileError {
        ProfileError { file: self.file.to_string(), line, col: 1, msg: msg.into() }
    }

    /// The problem `msg` about the profile as a whole: line 1, column 1.
    pub fn err_at_top(&self, msg: impl Into<String>) -> ProfileError {
        self.err_at_line(1, msg)
    }

    /// The line where `span` starts.
    pub fn line(&self, span: &Span) -> usize {
        line_col_of(self.text, span.start).0
    }
}

impl ProfileError {
    /// The file could not be read: no line or column.
    pub fn unreadable(file: &str, e: &std::io::Error) -> Self {
        Self {
            file: file.to_string(),
            line: 0,
            col: 0,
            msg: format!("cannot read the profile: {e}"),
        }
    }
}

/// Line and column (1-based) of a byte offset in `text`.
pub fn line_col_of(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map(|l| l.chars().count()).unwrap_or(0) + 1;
    (line, col)
}
