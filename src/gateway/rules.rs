//! What the gateway does about a target's answer: rules from what it sees to an action. The
//! first kind of rule matches status codes; the default rule set bans the proxy for the
//! target's domain on 403 and 429, the answers sites give a proxy they have blocked or are
//! throttling. Rules are data so that later kinds (bodies, latency) and actions (escalation up
//! to recycling a proxy) are new rows, not new branches in the forwarding code.

use hyper::StatusCode;

/// What a matching rule does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// End the lease as `banned` for the target's domain (the proxy rests for that domain
    /// only, for the store's ban cooldown); a session on it moves to another proxy on its
    /// next request.
    BanForDomain,
}

/// Answers with one of `statuses` trigger `action`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusRule {
    /// The status codes that match.
    pub statuses: Vec<u16>,
    /// What a match does.
    pub action: Action,
}

/// The rules, asked in order: the first that matches decides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rules(pub Vec<StatusRule>);

impl Default for Rules {
    fn default() -> Self {
        Self(vec![StatusRule {
            statuses: vec![403, 429],
            action: Action::BanForDomain,
        }])
    }
}

impl Rules {
    /// The action for a target's answer with `status`, if a rule matches.
    pub fn judge(&self, status: StatusCode) -> Option<Action> {
        self.0
            .iter()
            .find(|rule| rule.statuses.contains(&status.as_u16()))
            .map(|rule| rule.action)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_default_403_and_429_ban_and_nothing_else_does() {
        let rules = Rules::default();
        assert_eq!(rules.judge(StatusCode::FORBIDDEN), Some(Action::BanForDomain));
        assert_eq!(
            rules.judge(StatusCode::TOO_MANY_REQUESTS),
            Some(Action::BanForDomain)
        );
        for status in [200, 301, 404, 500, 503] {
            assert_eq!(
                rules.judge(StatusCode::from_u16(status).unwrap()),
                None,
                "{status}"
            );
        }
    }
}
