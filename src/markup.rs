//! Text escaped for XML and HTML: the libvirt domain XML's attribute values and the status
//! page's every value. One function, so the two markups cannot drift apart.

/// Escapes text for XML attribute values and element content; HTML5 knows the same five
/// entities, so it serves the status page's element content and quoted attributes too.
pub fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&apos;"),
            c => escaped.push(c),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::escape;

    #[test]
    fn every_html_special_character_is_escaped_and_the_rest_stays() {
        assert_eq!(
            escape(r#"<script>alert("x&'y")</script> Tom é"#),
            "&lt;script&gt;alert(&quot;x&amp;&apos;y&quot;)&lt;/script&gt; Tom é"
        );
    }
}
