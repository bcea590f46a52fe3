//! The authenticators' and header readers' unit tests.

use std::collections::BTreeMap;

use hyper::HeaderMap;

use super::*;

/// Headers holding `name: value` alone.
fn one_header(name: header::HeaderName, value: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(name, value.parse().expect("header"));
    headers
}

#[test]
fn the_authorization_header_is_read_once_for_every_scheme() {
    let with = |value: &str| presented(&one_header(header::AUTHORIZATION, value));
    let bearer = |t: &str| Presented::Bearer(t.to_owned());
    assert_eq!(presented(&HeaderMap::new()), Presented::Nothing);
    assert_eq!(with("Bearer abc"), bearer("abc"));
    assert_eq!(with("bearer  abc "), bearer("abc"));
    assert_eq!(
        with("BEARER abc"),
        bearer("abc"),
        "the scheme is case-insensitive"
    );
    assert_eq!(with("Bearer "), bearer(""));
    assert_eq!(with("Bearer"), Presented::Unusable);
    // "ui:tok:en": the password may hold a colon; the user name is not looked at.
    assert_eq!(
        with("Basic dWk6dG9rOmVu"),
        Presented::BasicPassword("tok:en".to_owned())
    );
    assert_eq!(with("Basic !!!"), Presented::Unusable);
    assert_eq!(with("Digest x"), Presented::Unusable);
}

#[test]
fn proxy_authorization_keeps_the_user_name() {
    let with = |value: &str| proxy_presented(&one_header(header::PROXY_AUTHORIZATION, value));
    assert_eq!(proxy_presented(&HeaderMap::new()), ProxyPresented::Nothing);
    // "ui:tok:en"
    assert_eq!(
        with("Basic dWk6dG9rOmVu"),
        ProxyPresented::Basic {
            user: "ui".to_owned(),
            password: "tok:en".to_owned()
        }
    );
    assert_eq!(with("Bearer abc"), ProxyPresented::Unusable);
    assert_eq!(with("Basic !!!"), ProxyPresented::Unusable);
    // Authorization is not Proxy-Authorization.
    assert_eq!(
        proxy_presented(&one_header(header::AUTHORIZATION, "Basic dWk6dG9rOmVu")),
        ProxyPresented::Nothing
    );
}

fn name(tokens: &StaticTokens, token: &str) -> Option<String> {
    tokens.by_digest.get(&digest(token)).cloned()
}

#[test]
fn the_keyed_digest_tells_tokens_apart_and_is_stable_within_the_process() {
    // Stable: a re-read file with the same tokens compares equal (no reload churn).
    assert_eq!(StaticTokens::parse("a\nb\n"), StaticTokens::parse("a\nb\n"));
    // Prefixes, extensions and the empty token each get their own digest.
    let tokens = ["", "t", "t1", "t12", "token-a", "token-b", "Token-a"];
    let digests: std::collections::HashSet<[u8; 16]> = tokens.iter().map(|t| digest(t)).collect();
    assert_eq!(digests.len(), tokens.len());
    let file = StaticTokens::parse("t1\n");
    assert_eq!(file.lookup("t1").map(|i| i.name), Ok("token-1".to_owned()));
    assert_eq!(file.lookup("t12"), Err(AuthError::Unauthenticated));
    assert_eq!(file.lookup("t"), Err(AuthError::Unauthenticated));
}

#[test]
fn a_secret_value_holds_one_token_or_one_per_line() {
    let map = BTreeMap::from([
        ("crawler-a".to_owned(), " token-a\n".to_owned()),
        ("fleet".to_owned(), "# two crawlers\nt1\n\nt2\n".to_owned()),
        ("empty".to_owned(), "  \n".to_owned()),
    ]);
    let tokens = StaticTokens::from_map(&map);
    assert_eq!(tokens.len(), 3);
    assert_eq!(name(&tokens, "token-a").as_deref(), Some("crawler-a"));
    assert_eq!(name(&tokens, "t1").as_deref(), Some("fleet-2"));
    assert_eq!(name(&tokens, "t2").as_deref(), Some("fleet-4"));
    assert_eq!(name(&tokens, ""), None);
}

/// Answers a fixed result for every token.
struct Fixed(Result<Identity, AuthError>);

#[async_trait]
impl Authenticator for Fixed {
    async fn authenticate(&self, _token: &str) -> Result<Identity, AuthError> {
        self.0.clone()
    }
}

fn fixed(answer: Result<Identity, AuthError>) -> Arc<dyn Authenticator> {
    Arc::new(Fixed(answer))
}

#[tokio::test]
async fn any_of_lets_the_first_that_knows_the_token_decide() {
    let ok = || Ok(Identity { name: "a".into() });
    let forbidden = || Err(AuthError::Forbidden("u".into()));
    let unknown = || Err(AuthError::Unauthenticated);
    let down = || Err(AuthError::Unavailable("down".into()));
    let cases = [
        (vec![unknown(), ok()], ok()),
        (vec![ok(), down()], ok()),
        (vec![unknown(), forbidden(), ok()], forbidden()),
        (vec![unknown(), unknown()], unknown()),
        // Nobody knows it and one could not be asked: not "invalid token".
        (vec![down(), unknown()], down()),
        (vec![unknown(), down()], down()),
        (vec![down(), ok()], ok()),
    ];
    for (answers, expected) in cases {
        let chain = AnyOf(answers.clone().into_iter().map(fixed).collect());
        assert_eq!(chain.authenticate("t").await, expected, "{answers:?}");
    }
}

#[tokio::test]
async fn only_the_opt_out_needs_no_token() {
    assert!(NoAuthentication.anonymous().is_some());
    assert!(StaticTokens::parse("t").anonymous().is_none());
    assert!(AnyOf(vec![]).anonymous().is_none());
}
