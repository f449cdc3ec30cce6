-- Personal values committed to by events (salted SM3 commitments in the payload). Rows can
-- be deleted (redaction: a RedactionApplied event records it) but never changed.
CREATE TABLE personal_data (
    event_id BLOB NOT NULL REFERENCES events (event_id),
    member   TEXT NOT NULL,
    value    TEXT NOT NULL, -- RFC 8785 text of the value
    salt     BLOB NOT NULL CHECK (length(salt) = 16),
    PRIMARY KEY (event_id, member)
);

CREATE TRIGGER personal_data_no_update BEFORE UPDATE ON personal_data
BEGIN
    SELECT RAISE(ABORT, 'personal data can be redacted (deleted), never changed');
END;
