//! The gateway's side of politeness ([`crate::politeness`]): a request's turn, held as long
//! as its lease is lent, or a 429 with `Retry-After`.

use super::{Gateway, Refusal, held::Lent};

impl Gateway {
    /// `lent` once its request's politeness turn came (the turn is held as long as the lease
    /// is lent); a 429 `politeness_limit` with `Retry-After` when it would wait too long (the
    /// lease goes back).
    pub(super) async fn polite(&self, lent: Lent, domain: Option<&str>) -> Result<Lent, Refusal> {
        if self.polite.is_off() {
            // Off (the default): nothing to wait for on the request's path.
            return Ok(lent);
        }
        let proxy = lent.proxy().clone();
        match self.polite.turn(&proxy.key, &proxy.attributes, domain).await {
            Ok(turn) => Ok(lent.with_turn(turn)),
            Err(no_turn) => {
                let mut refusal = Refusal::new(
                    hyper::StatusCode::TOO_MANY_REQUESTS,
                    "politeness_limit",
                    no_turn.to_string(),
                );
                refusal.retry_after = Some(no_turn.retry_after);
                Err(refusal)
            }
        }
    }
}
